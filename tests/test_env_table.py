"""docs/ENVIRONMENT.md lists exactly the environment variables that the code reads."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "gates", "benchmarks", "records", "reports", "tests")
READ = re.compile(r"""os\.(?:environ\.get|getenv|environ\.setdefault|environ\.pop)\(\s*["']([A-Z0-9_]+)["']"""
                  r"""|os\.environ\[\s*["']([A-Z0-9_]+)["']\s*\]""")


def names_in_code() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            if f.name == "test_env_table.py":  # its own examples are not reads
                continue
            for m in READ.finditer(f.read_text()):
                found.setdefault(m.group(1) or m.group(2), set()).add(str(f.relative_to(ROOT)))
    return found


def names_in_table() -> set[str]:
    rows = (ROOT / "docs" / "ENVIRONMENT.md").read_text().splitlines()
    return {m.group(1) for r in rows if (m := re.match(r"\|\s*`([A-Z0-9_]+)`\s*\|", r))}


def test_every_variable_read_is_documented_and_every_documented_one_is_read():
    code, table = names_in_code(), names_in_table()
    undocumented = {k: sorted(v) for k, v in code.items() if k not in table}
    assert not undocumented, f"read but not in docs/ENVIRONMENT.md: {undocumented}"
    stale = table - set(code)
    assert not stale, f"documented but read nowhere: {sorted(stale)}"


def test_the_scanner_sees_reads():
    """Negative control for the scan itself."""
    assert READ.search('x = os.environ.get("KIMI_FOO", "1")').group(1) == "KIMI_FOO"
    assert READ.search("os.environ['TRITON_INTERPRET']").group(2) == "TRITON_INTERPRET"


def test_make_test_hides_the_gpu():
    """`make test` is the CPU suite on any box: its recipe hides the GPU, so that conftest.py sets TRITON_INTERPRET.
    On a GPU box the CPU tests would otherwise meet compiled kernels, and some fail (CPU tensors handed to compiled
    kernels, bits that only the interpreter keeps: seen on the H200 in session 23)."""
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert re.search(r"(^|\s)CUDA_VISIBLE_DEVICES=\s", recipe), recipe
    assert not re.search(r"(^|\s)CUDA_VISIBLE_DEVICES=\s", "\t$(PY) -m pytest tests\n")  # the check can fail
