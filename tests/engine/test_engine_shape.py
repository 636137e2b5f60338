"""The engine's shape (issue 31, DESIGN.md section 6), checked on its source with `ast`: parts
are built with their collaborators and never patched afterwards; no function outside engine/build
and engine/core takes the engine; whether data parallelism is on is decided in one place (the
route build picks), not branched on. Each rule is also fed a synthetic violation, so that it is
seen to fail."""

from __future__ import annotations

import ast
import pathlib

import superoffload_hf.engine

ENGINE = pathlib.Path(superoffload_hf.engine.__file__).parent
PACKAGE = ENGINE.parent
MAY_TAKE_THE_ENGINE = {"build.py", "core.py"}
PICKS_THE_ROUTE = {"build.py"}

# what engine/build.py builds and hands on (the names the parts go by, as attributes and locals)
PART_NAMES = {"buckets", "worker", "waiter", "gather", "jobs", "flow", "speculation", "dp", "route", "collector",
              "committer", "gate", "observer", "transfer", "runtime", "adam", "reads", "policy", "loss_scale",
              "coll", "collectives", "engine"}


def _part_named(node: ast.expr) -> str | None:
    """`jobs` / `self.jobs` / `engine` (a part, by its name), else None."""
    if isinstance(node, ast.Name) and node.id in PART_NAMES:
        return node.id
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and node.attr in PART_NAMES):
        return f"self.{node.attr}"
    return None


def assignments_to_parts(source: str, filename: str = "<source>") -> list[str]:
    """`part.attr = ...` (or +=) anywhere: an attribute of a built part set from outside it."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and _part_named(t.value) is not None:
                    found.append(f"{filename}:{t.lineno}: {_part_named(t.value)}.{t.attr} = ...")
    return found


def functions_taking_the_engine(source: str, filename: str = "<source>") -> list[str]:
    """Functions with a parameter named `engine` or annotated `Engine`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "engine" or "Engine" in annotation.replace("'", "").replace('"', "").split("."):
                    found.append(f"{filename}:{node.lineno}: {getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


def _names_dp(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "dp") or (isinstance(node, ast.Attribute) and node.attr == "dp")


def dp_branches(source: str, filename: str = "<source>") -> list[str]:
    """`dp is None`, `x.dp is not None`, `if dp`, `if self.dp`, `not dp`, `dp and ...`: a branch on
    whether data parallelism is on."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        tested = []
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            tested = [node.left, *node.comparators]
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tested = [node.test]
        elif isinstance(node, ast.BoolOp):
            tested = node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tested = [node.operand]
        found += [f"{filename}:{node.lineno}: {ast.unparse(node)[:60]}" for t in tested if _names_dp(t)]
    return found


def _engine_sources():
    return sorted(ENGINE.rglob("*.py"))  # engine/ and its folders (state/, step/, dp/)


def test_no_attribute_of_a_part_is_assigned_after_it_is_built():
    found = [hit for path in _engine_sources() for hit in assignments_to_parts(path.read_text(), path.name)]
    assert found == []


def test_the_assignment_rule_sees_a_patched_part():
    source = ("def wire(jobs, flow):\n"
              "    jobs.gather = flow.gather\n"
              "class Engine:\n"
              "    def __init__(self):\n"
              "        self.waiter.reopen = None\n"
              "        self.layout = 1\n"
              "        rt.spec = None\n")
    assert assignments_to_parts(source) == ["<source>:2: jobs.gather = ...", "<source>:5: self.waiter.reopen = ..."]


def test_no_function_outside_build_and_core_takes_the_engine():
    found = [hit for path in _engine_sources() if str(path.relative_to(ENGINE)) not in MAY_TAKE_THE_ENGINE
             for hit in functions_taking_the_engine(path.read_text(), path.name)]
    assert found == []


def test_the_engine_rule_sees_a_function_that_takes_the_engine():
    source = ("def save(engine, groups): pass\n"
              "def load(e: 'Engine'): pass\n"
              "def view(owner: core.Engine): pass\n"
              "def fine(buckets, engines: list): pass\n")
    assert functions_taking_the_engine(source) == ["<source>:1: save(engine)", "<source>:2: load(e)",
                                                   "<source>:3: view(owner)"]


def test_nothing_branches_on_data_parallelism_outside_the_route_picker():
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if not (p.parent == ENGINE and p.name in PICKS_THE_ROUTE)]
    found = [hit for path in sources for hit in dp_branches(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert found == []


def test_the_branch_rule_sees_each_spelling():
    source = ("if self.dp is not None:\n    pass\n"
              "x = 1 if dp is None else 2\n"
              "if engine.dp:\n    pass\n"
              "ok = dp and dp.describe()\n"
              "if not self.dp:\n    pass\n"
              "if self.route.alone:\n    pass\n")
    assert sorted(int(hit.split(":")[1]) for hit in dp_branches(source)) == [1, 3, 4, 6, 7]


def private_engine_reads(source: str, filename: str = "<source>") -> list[str]:
    """`x._engine`: a test reaching into the optimizer's engine past the testing surface."""
    return [f"{filename}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.Attribute) and node.attr == "_engine"]


def test_tests_reach_the_engine_only_through_the_testing_surface():
    tests = pathlib.Path(__file__).resolve().parents[1]  # tests/, every folder
    found = [hit for path in sorted(tests.rglob("*.py")) for hit in private_engine_reads(path.read_text(), path.name)]
    assert found == []


def test_the_surface_rule_sees_a_test_reading_the_engine():
    assert private_engine_reads("ledger = opt._engine.buckets.ledger\n") == ["<source>:1: opt._engine"]
