"""Workbench for the RFC-0051 patch series against PyTorch (stdlib only).

Usage: python3 -m scripts.series <command> [options]   (from the repository root)

  setup           create .venv (Python 3.11, pinned requirements; --python 3.X: .venv-py3.X) and install the series
  workspace       build build/workspace: torch sources at the base + one commit per patch
  export          regenerate patches/ and patches/integrity.json from the workspace commits (byte-stable; no
                  author or date; refuses a series naming a person or a placeholder identity)
  apply CHECKOUT  git am --3way the series onto a PyTorch checkout (after checking series and checkout), as
                  your git identity there (--author 'Name <email>': as that)
  install         patch the torch/ files of a venv's torch, all or nothing (--through PATCH: a prefix;
                  --revert undoes; --force saves hand edits aside instead of refusing)
  status          pristine / current / stale / modified / interrupted state of the venv's torch
  radar           does the series still apply to another torch release wheel?
  upstream-tests  run the upstream test files that the series adds or changes (--python 3.X)
  peer-tests      PyTorch's own tests of the modules the series touches: pristine vs series (flag off/on)
  check-prefixes  every prefix 1..k applies, lints, imports, passes its tests (--quick: CI form)

Errors print `error: ...` and exit 2; a conflict (left recoverable) exits 1.

Modules, one guarantee each: git (errors, layout, git and wheels), patches (patch files, the series,
patches/integrity.json), workspace (import/export), apply (onto a checkout), install (the venv's torch,
all or nothing), radar, upstream (upstream tests), peer (peer tests), envs (setup, Python matrix), cli.
"""

from .apply import am_failure_report, applied_prefix, applier, apply_to_checkout, check_target, failed_paths, run_am
from .envs import (
    CUDA_VENV_FREE_BYTES, DEFAULT_PYTHON, OLDEST_PYTHON, UPSTREAM_TEST_REQUIREMENTS, check_free_disk, find_python,
    install_actionlint, matrix_venv, pinned_requirements, pip_fills, pip_install_one_at_a_time, python311, seed_from,
    setup, upstream_python, venv_requirements,
)
from .git import (
    BOT, FIXED_DATE, REPO_ROOT, Layout, SeriesConflict, SeriesError, blob_id, commit_all, configured_identity,
    extract_wheel_sources, find_wheel, git, git_dir, init_repo, isolated_env, operation_in_progress, parse_identity,
    pip_env, sha256_file, sha256_or_none, user_env,
)
from .install import (
    BACKUP_DIR, JOURNAL_DIR, STAMP_DIR, InstallState, classify, install, install_state, installed_torch, read_journal,
    read_stamp, record_hashes, revert, roll_back, site_packages, switch, torch_paths,
)
from .patches import (
    INTEGRITY, FileChange, Patch, describe_patches, final_paths, identity_problems, integrity_text, load_series,
    message_problems, parse_patch, post_images, prefix_length, series_hash, series_names, strip_identity,
    verify_integrity, verify_postimages, with_author, write_integrity,
)
from .radar import offset_files, radar
from .upstream import extract_tests, run_upstream_tests, upstream_test_env, upstream_test_files
from .workspace import FORMAT_PATCH_FLAGS, build_workspace, export, format_patches, workspace_problems
from .cli import main
