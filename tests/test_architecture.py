"""The rooms and what they may import; packaging (what `pip install .` installs and needs)."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vllm_temporalkv"


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports resolved against the package)."""
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _room(room: str) -> dict[Path, set[str]]:
    target = PKG / room
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    return {f: _imports(f) for f in files}


def _modules() -> dict[str, Path]:
    return {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f for f in PKG.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file: a lazy import is still a dependency), and
    the top-level names of the outside packages it imports.  ``from . import x`` of a submodule depends on x, not
    on the package's __init__."""
    mods = _modules()
    graph = {}
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [mod] + subs
            else:
                continue
            for t in targets:
                parts = t.split(".")
                known = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods),
                             None)
                if known is None:
                    out.add(parts[0])  # an outside package
                elif known != name:
                    out.add(known)
        graph[name] = out
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_no_import_cycles_in_the_package():
    """No module of the package reaches itself through its imports (lazy ones included: a function-level import
    that closes a circle only hides it)."""
    graph = _graph()
    cycles = sorted(m for m in graph if m in _reach(graph, m))
    assert not cycles, "modules on an import circle: " + ", ".join(cycles)


@pytest.mark.parametrize("module", ["vllm_temporalkv.methods", "vllm_temporalkv.formats", "vllm_temporalkv.layout"])
def test_the_arithmetic_reaches_no_torch(module):
    """The methods, the registry of formats and the page arithmetic are pure arithmetic, transitively (formats must
    not reach torch through layout, nor layout through anything)."""
    reach = _reach(_graph(), module)
    assert not reach & {"torch", "vllm", "triton", "numpy"}, sorted(reach)


def _calls_of(name: str, files) -> list[str]:
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                if called == name:
                    out.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    return out


def test_layer_caches_are_built_only_by_their_factory():
    """``LayerCache(...)`` is called only inside cache.py (``LayerCache.build`` and ``replace``): the backend, the
    benchmarks and the tests all build a layer's cache the one way."""
    files = [f for d in ("vllm_temporalkv", "benchmarks", "tests") for f in (ROOT / d).rglob("*.py")]
    assert _calls_of("LayerCache", [f for f in files if f != PKG / "cache.py"]) == []


def test_ops_do_not_probe_quantizers():
    """What a kernel may ask of a quantizer is declared (codecs.quantizer.Quantizer): no getattr probes in ops/."""
    probes = []
    for f in (PKG / "ops").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in ("post_rope", "packs_blocks", "code_layout", "outliers", "codec",
                                               "kernel_variant", "stats")):
                probes.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.args[1].value}")
    assert not probes, probes


def test_every_served_quantizer_declares_the_protocol(tiny_artifact):
    """Every format's quantizers, as a layer cache is built for serving, implement ``Quantizer``."""
    from vllm_temporalkv.artifact import Artifact
    from vllm_temporalkv.cache import LayerCache
    from vllm_temporalkv.codecs.quantizer import Quantizer
    from vllm_temporalkv.formats import FORMATS

    art = Artifact.load(tiny_artifact)
    D, H = art.fingerprint["head_dim"], art.fingerprint["num_kv_heads"]
    for name, f in FORMATS.items():
        if f.needs_calibration and not set(f.calibrated_formats) <= set(art.formats):
            continue
        lc = LayerCache.build(name, 0, head_dim=D, block_size=1024, dtype=torch.bfloat16, rope=None, num_kv_heads=H,
                              artifact=art)
        for q in (lc.k, lc.v):
            assert isinstance(q, Quantizer), (name, type(q))
            assert isinstance(q.post_rope, bool) and isinstance(q.packs_blocks, bool), name
        assert (lc.kernel_blocker is None) == f.needs_calibration, (name, lc.kernel_blocker)


FORBIDDEN = {
    # the method is checkable without kernels, calibration or vLLM
    "codecs": ("vllm_temporalkv.ops", "vllm_temporalkv.vllm", "vllm_temporalkv.calibration", "vllm", "triton",
               "numba", "fast_pytorch_kmeans"),
    "formats": ("torch", "vllm", "vllm_temporalkv.ops", "vllm_temporalkv.codecs"),
    "layout": ("vllm", "vllm_temporalkv.ops", "vllm_temporalkv.codecs", "vllm_temporalkv.vllm"),
    "artifact": ("vllm", "vllm_temporalkv.ops", "vllm_temporalkv.vllm", "vllm_temporalkv.calibration"),
    # fast paths are testable against the oracle without vLLM; serving never needs calibration
    "ops": ("vllm", "vllm_temporalkv.vllm", "vllm_temporalkv.calibration"),
    "calibration": ("vllm", "vllm_temporalkv.ops", "vllm_temporalkv.vllm"),
}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_import_only_downstream(room):
    bad = []
    for f, names in _room(room).items():
        for n in names:
            if any(n == p or n.startswith(p + ".") for p in FORBIDDEN[room]):
                bad.append(f"{f.relative_to(ROOT)} imports {n}")
    assert not bad, "\n".join(bad)


def test_only_the_vllm_room_imports_vllm():
    for f in PKG.rglob("*.py"):
        if (PKG / "vllm") in f.parents:
            continue
        assert not any(n == "vllm" or n.startswith("vllm.") for n in _imports(f)), f


def test_setup_installs_only_the_package_and_serving_deps():
    code = textwrap.dedent("""
        import json, setuptools
        captured = {}
        setuptools.setup = lambda **kw: captured.update(kw)
        exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__file__": "setup.py", "__name__": "__main__"})
        print(json.dumps({"packages": captured["packages"], "requires": captured["install_requires"],
                          "extras": sorted(captured["extras_require"]),
                          "scripts": captured["entry_points"]["console_scripts"]}))
    """)
    import json

    info = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])
    assert info["packages"] and all(p == "vllm_temporalkv" or p.startswith("vllm_temporalkv.") for p in info["packages"])
    assert "vllm_temporalkv.calibration" in info["packages"]
    assert {r.split(">")[0].split("=")[0] for r in info["requires"]} == {"torch", "safetensors"}
    assert {"calibrate", "bench", "test"} <= set(info["extras"])
    assert any(s.startswith("temporalkv-calibrate=") for s in info["scripts"])
    assert any(s.startswith("vllm-temporalkv=") for s in info["scripts"])


def test_serving_needs_no_calibration_or_benchmark_packages(tiny_artifact):
    """The plugin registers, loads an artifact and runs a cache update + attention on the serving
    path without importing any package that only the extras install."""
    code = textwrap.dedent(f"""
        import sys
        # packages only the extras bring (tqdm, gguf, transformers, accelerate, openai come with vLLM)
        EXTRAS = ("numba", "fast_pytorch_kmeans", "matplotlib")
        import torch
        from vllm_temporalkv.artifact import Artifact
        from vllm_temporalkv.formats import get_format
        from vllm_temporalkv.layout import PageLayout
        from vllm_temporalkv.ops import paged_torch
        from vllm_temporalkv.vllm import plugin
        plugin.register()
        art = Artifact.load({str(tiny_artifact)!r})
        fmt = get_format("temporalkv-2bit")
        H, D = art.fingerprint["num_kv_heads"], art.fingerprint["head_dim"]
        class Cfg:
            num_attention_heads, hidden_size, head_dim, rope_theta = 9, 576, 64, 100000.0
        from vllm_temporalkv.cache import LayerCache
        from vllm_temporalkv.rope import Rope
        lc = LayerCache.build(fmt, 0, head_dim=D, block_size=32, dtype=torch.bfloat16, rope=Rope(Cfg()), artifact=art)
        lay = lc.layout
        pages = torch.zeros(2, H, lay.bytes, dtype=torch.uint8)
        n = 40
        k, v = torch.randn(n, H, D).bfloat16(), torch.randn(n, H, D).bfloat16()
        q = torch.randn(n, 3 * H, D).bfloat16()
        pos = torch.arange(n)
        out = paged_torch.paged_attention(lc, pages, q, k, v, torch.tensor([0, n]), torch.tensor([n]),
                                          torch.tensor([[0, 1]]), 0.125)
        paged_torch.write_kv(lc, pages, k, v, pos, pos // 32)
        assert torch.isfinite(out.float()).all() and pages.any()
        used = sorted({{m.split(".")[0] for m in sys.modules}} & set(EXTRAS))
        assert not used, f"serving imported {{used}}"
        print("served")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "served" in r.stdout, r.stderr[-3000:]


# ---- the harness: tests, benchmarks and what they share (vllm_temporalkv/harness) ------------------------------

BENCH = ROOT / "benchmarks"
HARNESS = PKG / "harness"
BENCH_MAX_LINES = 450  # a benchmark module is read in one sitting: split a larger one (a package per benchmark)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _module_edges(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` a file imports, function-level imports included: ``from X import y`` is an edge to
    X.y where that is a module, else to X (``from . import submodule`` does not count as importing the package)."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:  # a name inside a module: the module
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def test_no_test_imports_benchmarks():
    """Tests run a benchmark as a program (``python -m benchmarks.X``, tests/helpers.py), never import it: what
    both need lives in the package (vllm_temporalkv/harness) or in tests/helpers.py.  Code handed to a subprocess
    (a string) is not an import of the test process."""
    bad = [f"{f.relative_to(ROOT)} imports {n}" for f in sorted((ROOT / "tests").rglob("*.py"))
           for n in _imports(f) if n == "benchmarks" or n.startswith("benchmarks.")]
    assert not bad, "\n".join(bad)


def test_no_test_file_imports_another():
    """Shared fixtures and helpers live in tests/conftest.py and tests/helpers.py, not in a test file."""
    bad = [f"{f.relative_to(ROOT)} imports {n}" for f in sorted((ROOT / "tests").glob("test_*.py"))
           for n in _imports(f) if n.startswith("tests.test_") or n.startswith("test_")]
    assert not bad, "\n".join(bad)


def test_benchmark_modules_are_short():
    long = {str(f.relative_to(ROOT)): n for f in sorted(BENCH.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > BENCH_MAX_LINES}
    assert not long, f"over {BENCH_MAX_LINES} lines: {long}"


def test_no_import_cycle_among_benchmarks():
    files = {_module_name(f): f for f in BENCH.rglob("*.py")}
    graph = {m: _module_edges(f, set(files)) for m, f in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (cycle := visit(n, path + [m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):])


def test_harness_reaches_no_vllm():
    """The harness (what tests and benchmarks share) imports no vLLM, directly or through the package's modules."""
    files = {_module_name(f): f for f in PKG.rglob("*.py")}
    names = {m: _imports(f) for m, f in files.items()}
    todo = [m for m in files if m.startswith("vllm_temporalkv.harness")]
    seen = set(todo)
    while todo:
        m = todo.pop()
        for n in names[m]:
            assert not (n == "vllm" or n.startswith("vllm.")), f"{m} imports {n}"
            assert not n.startswith("vllm_temporalkv.vllm"), f"{m} imports {n}"
            dep = n
            while dep and dep not in files:
                dep = dep.rpartition(".")[0]
            if dep and dep not in seen:
                seen.add(dep)
                todo.append(dep)


def test_nothing_in_the_package_imports_the_harness():
    """The serving path (vllm/, ops/, codecs/, formats, layout, artifact) and everything else in the package stand
    without the harness: only tests and benchmarks use it."""
    bad = [f"{f.relative_to(ROOT)} imports {n}" for f in sorted(PKG.rglob("*.py")) if HARNESS not in f.parents
           for n in _imports(f) if n.startswith("vllm_temporalkv.harness")]
    assert not bad, "\n".join(bad)


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (what ``from module import name`` can find there)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def test_benchmarks_import_what_exists():
    """Every ``from <benchmarks module> import name`` (function-level imports included, which no import of the module
    runs) names a module or a top-level name of that module: a moved function cannot leave a stale import behind."""
    files = {_module_name(f): f for f in BENCH.rglob("*.py")}
    bad = []
    for mod, f in sorted(files.items()):
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            parts = pkg.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base not in files:
                bad.append(f"{f.relative_to(ROOT)}: no module {base}")
                continue
            names = _top_level_names(files[base])
            bad += [f"{f.relative_to(ROOT)}: {base} has no {a.name}" for a in node.names
                    if a.name not in names and f"{base}.{a.name}" not in files]
    assert not bad, "\n".join(bad)
