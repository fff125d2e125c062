"""The repository's shape: module-level imports form no cycle, the pure math imports nothing of the run,
the root never imports the workshop (tools/), and lines stay within 100 columns (ruff.toml) but for a few."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT_MODULES = {p.stem for p in REPO.glob("*.py")}


def module_level_imports(path):
    """The project modules a file imports at module level (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & (ROOT_MODULES | {"tools"})


def all_imports(path):
    """Every project module a file imports, lazily inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & (ROOT_MODULES | {"tools"})


def find_cycle(graph):
    """A list of modules that import each other in a circle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return stack[stack.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_module_level_imports_have_no_cycle():
    graph = {p.stem: module_level_imports(p) - {p.stem} for p in REPO.glob("*.py")}
    assert find_cycle(graph) is None


def test_the_math_imports_nothing_of_the_run_and_the_root_no_tool():
    assert all_imports(REPO / "stare.py") <= {"kernels"}
    assert all_imports(REPO / "baselines.py") <= {"stare", "kernels"}
    for path in REPO.glob("*.py"):
        assert "tools" not in all_imports(path), f"{path.name} imports the workshop"


def test_lines_stay_within_100_columns_but_for_a_few():
    files = [*REPO.glob("*.py"), *REPO.glob("tools/*.py"), *REPO.glob("tests/*.py"), REPO / "README.md",
             *REPO.glob("docs/*.md")]
    lines = [line for path in files for line in path.read_text().splitlines()]
    long = [line for line in lines if len(line) > 100]
    assert len(long) <= 0.05 * len(lines), f"{len(long)} of {len(lines)} lines are over 100 columns"


def misplaced_comments(text):
    """Comment lines where a formatter leaves them and a reader does not look: between a decorator
    and its def, right before an except/else/elif/finally (the comment reads as the block's last
    line), or a `# noqa` alone on its line (it exempts nothing) -> [(line number, text)]."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        comment = line.strip()
        if not comment.startswith("#"):
            continue
        following = next((x.strip() for x in lines[i + 1:] if x.strip()), "")
        before = lines[i - 1].strip() if i else ""
        if ("noqa" in comment or before.startswith("@")
                or following.split(" ")[0].rstrip(":") in ("except", "else", "elif", "finally")):
            found.append((i + 1, comment))
    return found


def test_comments_sit_where_they_belong():
    assert misplaced_comments("@property\n# why\ndef f(self):\n    pass\n") == [(2, "# why")]
    assert misplaced_comments("try:\n    f()\n# why\nexcept OSError:\n    pass\n") == [(3, "# why")]
    assert misplaced_comments("x = 1\n# noqa: E731\n") == [(2, "# noqa: E731")]
    assert misplaced_comments("try:\n    f()\nexcept OSError:  # why\n    pass\n") == []
    files = [*REPO.glob("*.py"), *REPO.glob("tools/*.py"), *REPO.glob("tests/*.py")]
    found = [f"{path.name}:{n}: {comment}" for path in files
             for n, comment in misplaced_comments(path.read_text())]
    assert found == [], "\n".join(found)
