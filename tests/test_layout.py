"""The layout stays kept: no module of the engine or the app grows past the size a reader can hold at once."""

from pathlib import Path

MAX_MODULE_LINES = 600
ROOT = Path(__file__).resolve().parent.parent


def module_lines() -> dict[str, int]:
    """Every Python module under engine/ and app/, by its path from the repository root, and its line count."""
    return {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in ("engine", "app")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def test_modules_are_split_by_concern_below_the_line_limit():
    lines = module_lines()
    assert "app/cli.py" in lines and any(name.startswith("engine/") for name in lines)  # the walk found both trees
    over = [f"{name}: {n} lines" for name, n in sorted(lines.items()) if n > MAX_MODULE_LINES]
    assert not over, f"over {MAX_MODULE_LINES} lines (split by concern):\n" + "\n".join(over)
