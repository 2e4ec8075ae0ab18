"""The layout stays kept: no module of the engine or the app grows past the size a reader can hold at once."""

import ast
from pathlib import Path

from s2moe.engine import INTERNAL

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


def engine_imports(folder: str) -> list[tuple[str, int, str, str]]:
    """Every name a folder's modules import from the engine: (file, line, engine module, name), relative imports
    resolved to the installed names (app/x.py's `..engine.y` is s2moe.engine.y)."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = ["s2moe", *path.relative_to(ROOT).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "s2moe.engine" or module.startswith("s2moe.engine."):
                rel = str(path.relative_to(ROOT))
                found += [
                    (rel, node.lineno, module.removeprefix("s2moe.engine").lstrip("."), a.name) for a in node.names
                ]
    return found


def is_internal(module: str) -> bool:
    return any(module == m or (m.endswith(".*") and module.startswith(m[:-1])) for m in INTERNAL)


def test_front_ends_use_only_the_engines_public_modules():
    """The app and the scripts import no name of the engine's internal modules (engine.INTERNAL) and no private
    name anywhere in it; a module imported as a name (`from s2moe.engine.measure import bench`) counts too."""
    uses = engine_imports("app") + engine_imports("scripts")
    assert any(m == "measure.bench" for _, _, m, _ in uses)  # the walk resolved the app's relative imports
    wrong = []
    for where, line, module, name in uses:
        as_module = ROOT / "engine" / module.replace(".", "/") / name
        target = f"{module}.{name}".lstrip(".") if as_module.with_suffix(".py").is_file() else module
        if is_internal(target) or name.startswith("_"):
            wrong.append(f"{where}:{line}: {name} from s2moe.engine.{module}".replace("engine.:", "engine:"))
    assert not wrong, "front ends reach into the engine's internals:\n" + "\n".join(wrong)


def test_every_internal_module_exists():
    """A module renamed or removed leaves no stale entry behind in engine.INTERNAL."""
    for name in INTERNAL:
        path = ROOT / "engine" / name.replace(".*", "").replace(".", "/")
        assert path.with_suffix(".py").is_file() or path.is_dir(), name
