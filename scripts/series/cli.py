"""The command line: `python3 -m scripts.series <command>` (see the package docstring)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .apply import apply_to_checkout
from .envs import setup, upstream_python
from .git import REPO_ROOT, Layout, SeriesError, find_wheel
from .install import install, install_state, revert, site_packages
from .patches import load_series
from .peer import CONFIGS, run_peer_tests
from .radar import radar
from .upstream import run_upstream_tests, upstream_test_files
from .workspace import build_workspace, export


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.series", description=(PACKAGE_DOC or "").split("\n\n")[0])
    ap.add_argument("--repo-root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("setup", help="create .venv with the pinned requirements and install the series")
    st.add_argument("--venv", type=Path, default=None,
                    help="create this venv (default: .venv, or .venv-py3.X for --python 3.X)")
    st.add_argument("--python", metavar="3.X", default=None,
                    help="Python version of the venv (default 3.11; 3.11 or newer, e.g. 3.12); other versions get "
                    "torch, expecttest, numpy and pytest")
    st.add_argument("--through", metavar="PATCH", default=None,
                    help="install only the series up to and including PATCH (file name or 4-digit number)")
    w = sub.add_parser("workspace", help="build build/workspace at the base with one commit per patch")
    w.add_argument("--checkout", type=Path, help="a PyTorch git checkout holding the base commit")
    w.add_argument("--wheel", type=Path, help="the torch wheel to synthesize the base from")
    w.add_argument("--force", action="store_true", help="rebuild a clean, fully exported workspace")
    w.add_argument("--accept-patches", action="store_true",
                   help="import patch files that differ from patches/integrity.json (e.g. merged from another "
                   "branch); the next `export` records them")
    sub.add_parser("export", help="regenerate patches/ (and patches/integrity.json) from the workspace")
    a = sub.add_parser("apply", help="git am --3way the series onto a PyTorch checkout")
    a.add_argument("checkout", type=Path)
    a.add_argument("--author", metavar="'NAME <EMAIL>'", default=None,
                   help="write the commits as this person (default: your git identity in CHECKOUT)")
    for name in ("install", "status"):
        p = sub.add_parser(name, help="patch the venv's torch" if name == "install" else "state of the venv's torch")
        p.add_argument("--venv", type=Path, default=None, help="default: .venv in the repository root")
        p.add_argument("--site-packages", type=Path, default=None, help="patch this site-packages instead")
        p.add_argument("--through", metavar="PATCH", default=None,
                       help="only the series up to and including PATCH (file name or 4-digit number, e.g. 0003)"
                       + ("" if name == "install" else "; default: what the venv was installed with"))
        if name == "install":
            p.add_argument("--revert", action="store_true", help="restore the pristine torch files")
            p.add_argument("--force", action="store_true",
                           help="replace files edited by hand after saving them to site-packages/"
                           ".rfc0051-series-backups/<time>/")
    r = sub.add_parser("radar", help="check the series against another torch release wheel")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--wheel", type=Path)
    g.add_argument("--version")
    r.add_argument("--base-wheel", type=Path, help="default: the pinned torch wheel")
    u = sub.add_parser("upstream-tests", help="run the upstream test files the series adds or changes")
    u.add_argument("--python", default=None, help="a Python version (3.12: .venv-py3.12, made by `setup --python "
                   "3.12`) or an interpreter path; default: .venv/bin/python")
    u.add_argument("--tests-from", type=Path, default=None, help="a tree with the series applied (default: "
                   "extract the test files from the patches)")
    u.add_argument("--list", action="store_true", help="only print the selected test files")
    u.add_argument("--pytest", action="store_true", help="run them in one pytest session, as PyTorch's CI does")
    u.add_argument("extra", nargs="*", help="arguments passed to every test file (after --)")
    pt = sub.add_parser("peer-tests", help="PyTorch's own tests of the modules the series touches: pristine torch vs "
                        "the series (flag off, flag on), test by test")
    pt.add_argument("--tests-from", type=Path, default=None,
                    help="a folder laid out like a PyTorch checkout (DIR/test/...); default: ../shared/upstream-tests "
                    "beside the repository (or beside its local origin)")
    pt.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of pristine,off,on")
    pt.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    pt.add_argument("--pytest-args", default="", help="more pytest arguments, one shell-quoted string")
    pt.add_argument("--venv", type=Path, default=None, help="default: .venv")
    pt.add_argument("--jobs", type=int, default=2, help="configurations run side by side (default 2)")
    pt.add_argument("--baseline", type=Path, default=None, help="the pristine baseline (default: ci/peer-baseline.json)"
                    "; its outcomes stand in for a pristine run of each file whose key matches")
    pt.add_argument("--no-baseline", action="store_true", help="run pristine whatever the baseline holds")
    pt.add_argument("--refresh-baseline", action="store_true", help="run only pristine, --repeat times, and write "
                    "the baseline of the selected files (tests whose outcome differs between repeats: flaky)")
    pt.add_argument("--repeat", type=int, default=2, help="pristine runs of --refresh-baseline (default 2)")
    pt.add_argument("files", nargs="*", help="test files under DIR/test (default: those DIR/selection.txt lists, else "
                    "every test_*.py of a stored folder; a PyTorch checkout must name them)")
    cp = sub.add_parser("check-prefixes", help="every prefix 1..k of the series, on pristine torch: applies, lints, "
                        "imports (torch.fx public API), passes its upstream tests and related peer files")
    cp.add_argument("--quick", action="store_true", help="CI form: apply, lint, import + API, and only the tests each "
                    "patch adds or changes; no peer files")
    cp.add_argument("--through", metavar="PATCH", default=None, help="check prefixes up to PATCH only")
    cp.add_argument("--tests-from", type=Path, default=None, help="the peer files' folder (as peer-tests)")
    cp.add_argument("--venv", type=Path, default=None, help="default: .venv")
    cp.add_argument("--ignore-record", action="store_true", help="--quick: check every prefix, also those recorded as "
                    "passing in ci/prefix-results.json (the record is rewritten)")
    cp.add_argument("--keep-going", action="store_true", help="check the later prefixes after a failing one (unless "
                    "it does not apply)")
    return ap


def run(args: argparse.Namespace) -> int:
    layout = Layout(args.repo_root.resolve())
    if args.cmd == "setup":
        print(setup(layout, args.venv.absolute() if args.venv else None, args.through, args.python))
    elif args.cmd == "workspace":
        build_workspace(layout, args.checkout, args.wheel, args.force, args.accept_patches)
    elif args.cmd == "export":
        export(layout)
    elif args.cmd == "apply":
        return apply_to_checkout(layout, args.checkout, args.author)
    elif args.cmd in ("install", "status"):
        sp = args.site_packages or site_packages(args.venv or layout.venv)
        pinned = layout.base()["torch_version"]
        series = load_series(layout.patches)  # verified before anything is read or changed

        def wheel() -> Path:
            return find_wheel(pinned, layout.wheels)
        if args.cmd == "status":
            st = install_state(sp, series, pinned, args.through, follow_stamp=True)
            print(f"{st.state}: {st.detail}")
        elif args.revert:
            if args.through:
                raise SeriesError("--revert restores the wheel's files; it takes no --through")
            print(revert(sp, pinned, series, args.force, wheel))
        else:
            print(install(sp, series, pinned, args.through, args.force, wheel))
    elif args.cmd == "radar":
        series = load_series(layout.patches)
        target = args.wheel or find_wheel(args.version, layout.wheels)
        base_wheel = args.base_wheel or find_wheel(layout.base()["torch_version"], layout.wheels)
        results = radar(series, base_wheel, target)
        print(f"rebase radar: {len(series)} patch(es) from {base_wheel.name} onto {target.name}")
        for name, status, files in results:
            print(f"  {name}: {status}" + (f"  [{', '.join(files)}]" if files else ""))
        return 1 if any(s == "conflict" for _, s, _ in results) else 0
    elif args.cmd == "upstream-tests":
        series = load_series(layout.patches)
        if args.list:
            print("\n".join(upstream_test_files(series)))
            return 0
        return run_upstream_tests(series, upstream_python(layout, args.python), args.tests_from, args.extra,
                                  args.pytest)
    elif args.cmd == "peer-tests":
        extra = (["-k", args.keyword] if args.keyword else []) + shlex.split(args.pytest_args)
        if args.no_baseline and (args.refresh_baseline or args.baseline):
            raise SeriesError("--no-baseline takes neither --baseline nor --refresh-baseline")
        return run_peer_tests(layout, args.tests_from, args.files, [c for c in args.configs.split(",") if c],
                              extra, args.venv.absolute() if args.venv else None, args.jobs,
                              args.baseline.absolute() if args.baseline else None, args.refresh_baseline,
                              args.repeat, use_baseline=not args.no_baseline)
    elif args.cmd == "check-prefixes":
        from .prefixes import check_prefixes
        return check_prefixes(layout, args.through, args.quick, args.venv.absolute() if args.venv else None,
                              args.tests_from, args.keep_going, args.ignore_record)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted (an install or revert is never left half-done: `status` tells the venv's state)", file=sys.stderr)
        return 130
