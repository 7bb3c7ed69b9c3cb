"""The package as a user installs it: a wheel built from the checkout, installed non-editably into
a directory of its own, imported and run from a folder that holds a user's own `models/` and
`tools/` packages (which must neither shadow ours nor be shadowed)."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Imports every module the wheel holds, from the install directory only, beside a user's own
# `models` and `tools` packages in the working directory.
_IMPORT_ALL = """
import importlib, json, pathlib, sys
site = pathlib.Path(sys.argv[1]).resolve()
names = json.loads(sys.argv[2])
wrong = []
for name in names:
    module = importlib.import_module(name)
    if not pathlib.Path(module.__file__).resolve().is_relative_to(site):
        wrong.append(f"{name} from {module.__file__}")
import models, tools
assert models.USERS_OWN and tools.USERS_OWN, "the user's own packages were shadowed"
import oases_jax.planner.calibration.profile as profile
assert profile.default_profile_path("cpu", 8).is_file(), "the committed profiles are missing"
from oases_jax import provenance
assert provenance.commit() == (None, False), "an installed copy claims a checkout's commit"
print(json.dumps({"imported": len(names), "wrong": wrong}))
"""


def _modules(wheel: pathlib.Path) -> list[str]:
    """Dotted names of every Python module in a wheel."""
    out = []
    for name in zipfile.ZipFile(wheel).namelist():
        if name.endswith(".py"):
            parts = name[:-3].split("/")
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(out)


def _source_tree(dest: pathlib.Path) -> pathlib.Path:
    """The checkout's files as a clean clone has them (tracked, or new and not ignored), so no
    build directory left from an earlier build (with modules since deleted) reaches the wheel."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(install directory, the wheel's module names, a user's working directory)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist, site, user = tmp / "dist", tmp / "site", tmp / "user"
    tree = _source_tree(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
                    str(tree)], check=True, capture_output=True, timeout=600)
    (wheel,) = dist.glob("oases_jax-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    for own in ("models", "tools"):
        (user / own).mkdir(parents=True)
        (user / own / "__init__.py").write_text("USERS_OWN = True\n")
    return site, _modules(wheel), user


def _env(site: pathlib.Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return env


def test_the_wheel_holds_every_library_package(installed):
    _, names, _ = installed
    folders = {"models", "training", "tools", "planner", "scripts"}
    for folder in folders:
        expect = {f"oases_jax.{folder}." + ".".join(p.relative_to(ROOT / folder)
                                                   .with_suffix("").parts)
                  for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py"}
        assert expect <= set(names), sorted(expect - set(names))
    assert not {n for n in names if n.split(".")[0] != "oases_jax"}, "a generic top-level name"


def test_every_module_imports_from_the_install_beside_a_users_own_packages(installed):
    import json

    site, names, user = installed
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(site), json.dumps(names)],
                         capture_output=True, text=True, cwd=user, env=_env(site), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report == {"imported": len(names), "wrong": []}


def test_the_entry_points_run_from_outside_the_checkout(installed, tmp_path):
    site, _, user = installed
    for prog in ("oases-train", "oases-plan", "oases-inspect", "oases-bench", "oases-calibrate"):
        out = subprocess.run([str(site / "bin" / prog), "--help"], capture_output=True,
                             text=True, cwd=user, env=_env(site), timeout=300)
        assert out.returncode == 0 and "usage:" in out.stdout, (prog, out.stderr[-2000:])
    out = subprocess.run([str(site / "bin" / "oases-train"), "--model", "tiny", "--steps", "3",
                          "--no-progress", "--out-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=user, env=_env(site), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "steps 1..3 (done)" in out.stdout
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
