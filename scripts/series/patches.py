"""Patch files: parsing, the ordered series, prefixes and the integrity record that `export` writes.

`patches/integrity.json` holds, per patch file, the sha256 of the file and of each of its
`diff --git` sections, and per section the path(s) with the pre- and post-image blob ids of its
`--full-index` `index` line. Every command verifies it before touching anything, so a patch that is
truncated (even exactly between two sections), edited by hand or damaged is refused by name.

A patch file carries no author and no date: `export` writes the mail with `From: RFC-0051 patch series <>`
(no address: `git am` needs a name) and no `Date:` (strip_identity), and refuses one with an identity or a
placeholder address (identity_problems); `apply` gives each commit its applier's identity (with_author).
Files of an older export that still carry an author are read all the same.
"""

from __future__ import annotations

import dataclasses
import email.utils
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

from .git import SeriesError, git, isolated_env

INTEGRITY = "integrity.json"
INTEGRITY_FORMAT = 1
NULL_BLOB = "0" * 40
REGENERATE = ("restore it with `git checkout -- patches/`, or, if build/workspace holds the series' commits, "
              "regenerate patches/ from them with `python3 -m scripts.series export`")


@dataclasses.dataclass(frozen=True)
class FileChange:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    new_blob: str | None  # full blob id of the result (from a --full-index `index` line)
    old_blob: str | None = None  # full blob id before the patch

    @property
    def paths(self) -> list[str]:
        return [p for p in dict.fromkeys((self.old_path, self.new_path)) if p]


@dataclasses.dataclass(frozen=True)
class Patch:
    path: Path
    subject: str
    message: str  # the commit message after the subject (git mailinfo's), stripped
    changes: tuple[FileChange, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def paths(self, prefix: str = "") -> list[str]:
        out = [p for c in self.changes for p in c.paths if p.startswith(prefix)]
        return list(dict.fromkeys(out))


DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)")


def parse_changes(text: str) -> list[FileChange]:
    changes: list[FileChange] = []
    cur: dict[str, str | None] | None = None
    in_header = False
    for line in text.splitlines():
        m = DIFF_RE.match(line)
        if m:
            if cur is not None:
                changes.append(FileChange(cur["old"], cur["new"], cur["blob"], cur["pre"]))
            cur, in_header = {"old": m.group(1), "new": m.group(2), "blob": None, "pre": None}, True
            continue
        if cur is None or not in_header:
            continue
        if line.startswith(("--- ", "@@", "GIT binary patch", "Binary files")):
            in_header = False
        elif line.startswith("new file mode"):
            cur["old"] = None
        elif line.startswith("deleted file mode"):
            cur["new"] = None
        elif (im := INDEX_RE.match(line)) and len(im.group(2)) == 40:
            cur["blob"] = im.group(2)
            cur["pre"] = im.group(1) if len(im.group(1)) == 40 else None
    if cur is not None:
        changes.append(FileChange(cur["old"], cur["new"], cur["blob"], cur["pre"]))
    return changes


def parse_patch(path: Path) -> Patch:
    """Read a git format-patch file; raise SeriesError naming the defect if it is unusable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SeriesError(f"cannot read patch {path}: {exc}") from exc
    if not data.strip():
        raise SeriesError(f"patch {path} is empty")
    text = data.decode("utf-8", errors="surrogateescape")
    if not text.startswith("From "):
        raise SeriesError(f"patch {path} is not a git format-patch file (no leading 'From ' line)")
    if not data.endswith(b"\n"):
        raise SeriesError(f"patch {path} is truncated (its last line has no newline)")
    with tempfile.TemporaryDirectory() as tmp:
        info = subprocess.run(["git", "mailinfo", "-b", f"{tmp}/msg", f"{tmp}/diff"], input=data,
                              capture_output=True, cwd=tmp, env=isolated_env(False))
        if info.returncode != 0:
            raise SeriesError(f"patch {path} has an unreadable mail header: {info.stderr.decode(errors='replace').strip()}")
        fields = dict(line.split(": ", 1) for line in info.stdout.decode("utf-8", "replace").splitlines() if ": " in line)
        message = Path(f"{tmp}/msg").read_bytes().decode("utf-8", "replace")
        check = subprocess.run(["git", "apply", "--numstat", f"{tmp}/diff"], capture_output=True, text=True,
                               cwd=tmp, env=isolated_env(False))
    if not fields.get("Subject"):
        raise SeriesError(f"patch {path} has no Subject header")
    if check.returncode != 0:
        raise SeriesError(f"patch {path} is corrupt or truncated: {check.stderr.strip()}")
    changes = parse_changes(text)
    if not changes:
        raise SeriesError(f"patch {path} contains no diff")
    return Patch(path, fields["Subject"].strip(), normalize_message(message), tuple(changes))


def normalize_message(message: str) -> str:
    """A commit message body as `git am` leaves it, for comparing: trailing blanks and blank lines dropped."""
    return "\n".join(line.rstrip() for line in message.strip().splitlines())


# --------------------------------------------------------------------------- identity (no author in patches/)


IDENTITY_HEADERS = ("from", "date", "sender", "reply-to", "to", "cc")
# The `From:` line of an exported patch: `git am` refuses a mail without an author name, so the series
# names itself, with no address (no person, nothing a CLA check could match); `apply` replaces it with the
# applier's identity (with_author).
UNATTRIBUTED = b"From: RFC-0051 patch series <>"
# Addresses and names that stand in for a person: reserved domains (RFC 2606/6761), no-reply forwarders,
# and the seed repository's maintainers ("Seed 5ce6a553 maintainers").
PLACEHOLDER_RES = (
    re.compile(r"@(?:[\w-]+\.)*(?:[\w-]+\.(?:example|invalid)|example\.(?:com|org|net))\b", re.I),
    re.compile(r"example\.invalid|noreply", re.I),
    re.compile(r"\bSeed [0-9a-f]{6,}\b"),
)
ADDRESS_RE = re.compile(r"<[^<>\s]*@[^<>\s]*>|^[\w-]+-by:.*@.*$", re.M | re.I)


def split_mail(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(the mail header with its leading `From <sha> <date>` line, the message up to the first
    `diff --git`, the diff)."""
    end = data.find(b"\n\n")
    header, rest = (data, b"") if end < 0 else (data[: end + 1], data[end + 1:])
    diff = re.search(rb"^diff --git ", rest, re.M)
    return (header, rest, b"") if diff is None else (header, rest[: diff.start()], rest[diff.start():])


def strip_identity(data: bytes) -> bytes:
    """The patch without its identity header fields (`From: name <email>`, `Date:` and the other address
    fields, each with its folded continuation lines), `From:` replaced by UNATTRIBUTED; the mbox
    `From <sha> <date>` line, the Subject, the message and the diff stay byte for byte."""
    header, message, diff = split_mail(data)
    lines = header.splitlines(keepends=True)
    kept: list[bytes] = lines[:1]
    dropping = False
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):  # a folded continuation of the field above
            if not dropping:
                kept.append(line)
            continue
        name = line.split(b":", 1)[0].strip().lower().decode("ascii", "replace")
        dropping = b":" in line and name in IDENTITY_HEADERS
        if not dropping:
            kept.append(line)
    kept.insert(1, UNATTRIBUTED + b"\n")
    return b"".join(kept) + message + diff


def with_author(data: bytes, name: str, email_address: str) -> bytes:
    """The patch as a mail from name <email_address> (what `git am` takes the author from), with no
    Date (so the commit's date is when it is applied)."""
    stripped = strip_identity(data)
    sender = email.utils.formataddr((name, email_address), charset="utf-8")
    return stripped.replace(UNATTRIBUTED, b"From: " + sender.encode("utf-8"), 1)


def identity_problems(data: bytes) -> list[str]:
    """What in a patch file names a person or a stand-in for one: identity header fields, e-mail
    addresses in the header or message (`Signed-off-by: ... <...>`), placeholder addresses and names
    anywhere in the file. Empty: the file is free of them."""
    header, message, _ = split_mail(data)
    text = data.decode("utf-8", "surrogateescape")
    problems = []
    for line in header.decode("utf-8", "surrogateescape").splitlines()[1:]:
        field = line.split(":", 1)[0].strip()
        if ":" in line and field.lower() in IDENTITY_HEADERS and line.encode() != UNATTRIBUTED:
            problems.append(f"a {field}: header ({line.strip()[:60]!r})")
    for m in ADDRESS_RE.finditer((header + message).decode("utf-8", "surrogateescape")):
        problems.append(f"an e-mail address in its header or message ({m.group(0).strip()[:60]!r})")
    for rx in PLACEHOLDER_RES:
        for m in rx.finditer(text):
            problems.append(f"a placeholder identity on line {text.count(chr(10), 0, m.start()) + 1} ({m.group(0)!r})")
    return list(dict.fromkeys(problems))


# The comment lines git writes into a message it does not open in an editor: `git commit --no-edit` after a
# conflicted `git rebase` step keeps "# Conflicts:" and the conflicted paths, each starting with "#" and a blank.
GIT_COMMENT_RE = re.compile(r"^#(?:[ \t].*)?$", re.M)


def message_problems(data: bytes) -> list[str]:
    """Git comment lines in a patch's commit message (the text between the header and the diff), each as
    its line number in the file and its text. Empty: the message is only what its author wrote."""
    header, message, _ = split_mail(data)
    start = header.count(b"\n")
    text = message.decode("utf-8", "surrogateescape")
    return [f"a git comment line on line {start + text.count(chr(10), 0, m.start()) + 1} ({m.group(0)[:60]!r})"
            for m in GIT_COMMENT_RE.finditer(text)]


def series_names(patches_dir: Path) -> list[str]:
    order = patches_dir / ".patches"
    if not order.is_file():
        raise SeriesError(f"{order} is missing (it lists the patch files in order, one per line)")
    names = [ln.split("#", 1)[0].strip() for ln in order.read_text(errors="replace").splitlines()]
    names = [n for n in names if n]
    for n in names:
        if "/" in n or not n.endswith(".patch"):
            raise SeriesError(f"{order}: {n!r} is not a patch file name in {patches_dir}")
        if not (patches_dir / n).is_file():
            raise SeriesError(f"{order} lists {n}, but {patches_dir / n} does not exist")
    if len(set(names)) != len(names):
        raise SeriesError(f"{order} lists a patch twice")
    unlisted = sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in names)
    if unlisted:
        raise SeriesError(f"{patches_dir} has patch files not listed in {order}: {', '.join(unlisted)} "
                          "(add them to .patches or delete them)")
    return names


def load_series(patches_dir: Path, verify: bool = True) -> list[Patch]:
    """The series in order; with verify (every command but `workspace --accept-patches`), only after
    checking each file against patches/integrity.json."""
    names = series_names(patches_dir)
    if verify:
        verify_integrity(patches_dir, names)
    return [parse_patch(patches_dir / n) for n in names]


def final_paths(series: list[Patch]) -> tuple[list[str], set[str]]:
    """(the paths the series leaves in the tree, in first-touched order; the ones it creates)."""
    final: dict[str, bool] = {}
    created: set[str] = set()
    for patch in series:
        for c in patch.changes:
            if c.old_path and c.old_path != c.new_path:
                final[c.old_path] = False
            if c.new_path:
                final[c.new_path] = True
                if c.old_path is None:
                    created.add(c.new_path)
    return [p for p, alive in final.items() if alive], created


def series_hash(series: list[Patch]) -> str:
    h = hashlib.sha256()
    for p in series:
        h.update(p.name.encode() + b"\0" + p.path.read_bytes() + b"\0")
    return h.hexdigest()


def verify_postimages(repo: Path, commits: list[str], series: list[Patch], prefix: str = "") -> None:
    """Each commit must hold exactly the blobs its patch's `index` lines promise (catches a patch
    truncated at a hunk boundary or edited by hand)."""
    for commit, patch in zip(commits, series, strict=True):
        for change in patch.changes:
            if not change.new_path or not change.new_blob or not change.new_path.startswith(prefix):
                continue
            got = git(repo, "rev-parse", f"{commit}:{change.new_path}", check=False).stdout.strip()
            if got != change.new_blob:
                raise SeriesError(
                    f"patch {patch.name}: the result for {change.new_path} is not the blob its index line "
                    f"records ({change.new_blob[:12]}, got {got[:12] or 'nothing'}); the patch file is truncated "
                    "or was edited by hand: regenerate it with `workspace` + `export`")


# --------------------------------------------------------------------------- prefixes (--through)


def prefix_length(series: list[Patch], through: str | None) -> int:
    """How many leading patches `--through PATCH` selects: PATCH is a file name of the series or its
    4-digit number (`0003`); None selects the whole series."""
    if through is None:
        return len(series)
    names = [p.name for p in series]
    key = through.strip()
    for i, name in enumerate(names):
        if key in (name, name.removesuffix(".patch")) or (key.isdigit() and len(key) == 4 and name.startswith(key + "-")):
            return i + 1
    listing = ", ".join(names) or "(the series is empty)"
    raise SeriesError(f"--through {through}: no such patch in the series; give a file name from patches/.patches "
                      f"or its 4-digit number: {listing}")


def describe_patches(names: list[str], series: list[Patch]) -> str:
    """'patches 0001..0003 of 9' when names are a prefix of the series, else the names themselves."""
    total = len(series)
    if names == [p.name for p in series[: len(names)]]:
        if not names:
            return f"no patches of {total}"
        first, last = (n.split("-", 1)[0] for n in (names[0], names[-1]))
        return f"patch {first} of {total}" if len(names) == 1 else f"patches {first}..{last} of {total}"
    return f"patches {', '.join(names) or '(none)'}, not a prefix of the current series of {total}"


# --------------------------------------------------------------------------- integrity record


def split_sections(data: bytes) -> tuple[bytes, list[bytes]]:
    """The mail header and message, then each `diff --git` section, as bytes."""
    starts = [m.start() for m in re.finditer(rb"^diff --git ", data, re.M)]
    if not starts:
        return data, []
    bounds = starts + [len(data)]
    return data[: starts[0]], [data[a:b] for a, b in zip(bounds, bounds[1:])]


def section_record(section: bytes) -> dict[str, str | None]:
    text = section.decode("utf-8", errors="surrogateescape")
    changes = parse_changes(text)
    change = changes[0] if changes else FileChange(None, None, None)
    first = text.split("\n", 1)[0]
    return {"path": change.new_path or change.old_path or first, "old_path": change.old_path,
            "new_path": change.new_path, "pre": change.old_blob, "post": change.new_blob,
            "sha256": hashlib.sha256(section).hexdigest()}


def patch_record(data: bytes) -> dict[str, object]:
    header, sections = split_sections(data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "header_sha256": hashlib.sha256(header).hexdigest(),
            "files": [section_record(s) for s in sections]}


def integrity_text(patches_dir: Path, names: list[str]) -> str:
    """The integrity record of the patch files `names` in patches_dir (deterministic JSON)."""
    record = {"format": INTEGRITY_FORMAT, "series": names,
              "patches": {n: patch_record((patches_dir / n).read_bytes()) for n in names}}
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def write_integrity(patches_dir: Path, names: list[str]) -> bool:
    """Write patches/integrity.json for these files; True when its content changed."""
    path = patches_dir / INTEGRITY
    text = integrity_text(patches_dir, names)
    if path.is_file() and path.read_text(errors="replace") == text:
        return False
    path.write_text(text)
    return True


def describe_difference(name: str, recorded: dict, data: bytes) -> str:
    """What differs between the patch file `name` (data) and what `export` recorded for it."""
    header, sections = split_sections(data)
    have = {}
    for s in sections:
        rec = section_record(s)
        have[rec["path"]] = rec
    problems = []
    if hashlib.sha256(header).hexdigest() != recorded.get("header_sha256"):
        problems.append("its mail header or commit message differs")
    want_paths = [f.get("path") for f in recorded.get("files", [])]
    for f in recorded.get("files", []):
        got = have.get(f.get("path"))
        if got is None:
            problems.append(f"the `diff --git` section for {f.get('path')} is missing")
        elif got["sha256"] != f.get("sha256"):
            problems.append(f"the section for {f.get('path')} differs (truncated or edited)")
    for path in have:
        if path not in want_paths:
            problems.append(f"it has a section for {path} that was not exported")
    if not problems:
        problems.append("its bytes differ (sha256)")
    return f"patch {name}: " + "; ".join(problems)


def verify_integrity(patches_dir: Path, names: list[str]) -> dict:
    """Check the patch files against patches/integrity.json; raise SeriesError naming each
    patch that differs and how. Returns the record."""
    path = patches_dir / INTEGRITY
    if not path.is_file():
        if not names:
            return {"format": INTEGRITY_FORMAT, "series": [], "patches": {}}
        raise SeriesError(f"{path} is missing, so the patch files cannot be verified; if patches/ holds the series "
                          "you want, record it: `python3 -m scripts.series workspace --force --accept-patches`, "
                          "then `python3 -m scripts.series export`")
    try:
        record = json.loads(path.read_text())
        assert isinstance(record, dict) and record.get("format") == INTEGRITY_FORMAT
        assert isinstance(record.get("series"), list) and isinstance(record.get("patches"), dict)
    except (OSError, ValueError, AssertionError) as exc:
        raise SeriesError(f"{path} is damaged or of an unknown format ({exc or 'bad structure'}); restore it with "
                          "`git checkout -- patches/`, or re-record the series: `workspace --force --accept-patches` "
                          "+ `export`") from None
    problems = []
    if record["series"] != names:
        gone = [n for n in record["series"] if n not in names]
        new = [n for n in names if n not in record["series"]]
        problems.append("patches/.patches does not list the exported series"
                        + (f"; missing: {', '.join(gone)}" if gone else "")
                        + (f"; not exported: {', '.join(new)}" if new else "")
                        + ("; the order differs" if not gone and not new else ""))
    for n in names:
        rec = record["patches"].get(n)
        if rec is None:
            continue
        data = (patches_dir / n).read_bytes()
        if hashlib.sha256(data).hexdigest() != rec.get("sha256"):
            problems.append(describe_difference(n, rec, data))
        elif rec != patch_record(data):
            problems.append(f"the record of {n} in {INTEGRITY} is damaged (the patch file itself matches its digest); "
                            "restore it with `git checkout -- patches/` or rerun `export`")
    if problems:
        raise SeriesError("the patch files differ from what `export` recorded in " + str(path) + ":\n  - "
                          + "\n  - ".join(problems)
                          + "\nNothing was changed. A patch file is truncated or was edited by hand: " + REGENERATE
                          + ". If these files are what you want (e.g. exported on another branch and merged here), "
                          "re-record them: `python3 -m scripts.series workspace --force --accept-patches`, then "
                          "`python3 -m scripts.series export`.")
    return record


def post_images(series: list[Patch], prefix: str = "") -> dict[str, set[str]]:
    """Per file, every blob id the series gives it after one of its patches (the series' post-images)."""
    out: dict[str, set[str]] = {}
    for patch in series:
        for c in patch.changes:
            if c.new_path and c.new_blob and c.new_path.startswith(prefix):
                out.setdefault(c.new_path, set()).add(c.new_blob)
    return out
