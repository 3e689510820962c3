"""The SGLang client (rollout/sglang_engine.py) against SGLang's own request schema, not only the fake server.

Read from the sglang package's source, parsed (``ast``) and never imported (its import needs CUDA kernels):
the HTTP routes of ``sglang/srt/entrypoints/http_server.py`` and the request struct each route's handler takes
(``obj: GenerateReqInput``, ``UpdateWeightFromDiskReqInput``, ...; fields from ``sglang/srt/managers/io_struct.py``
with their bases), the ``SamplingParams`` fields (``sglang/srt/sampling/sampling_params.py``) and the
server's command-line flags (``sglang/srt/server_args.py`` and ``sglang/srt/arg_groups/``). Every request the client sends while it generates,
updates weights (tensors and disk), reads a weight back, releases and resumes memory (recorded against the fake
server) must use a route SGLang serves and only fields its request struct has, and the launch command only
flags SGLang defines.

The source: the installed ``sglang`` package, or ``DSV4_SGLANG_SOURCE`` (an sglang wheel or a folder holding
the ``sglang`` package). Neither is in the CPU venv (the wheel is 39 MB and pulls CUDA packages), so in CI the
test skips with that reason; checked here against sglang 0.5.23 (``pip download sglang --no-deps``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest
import torch

from core.config import preset

CFG = preset("tiny")
FILES = {"http": "sglang/srt/entrypoints/http_server.py", "io": "sglang/srt/managers/io_struct.py",
         "sampling": "sglang/srt/sampling/sampling_params.py", "args": "sglang/srt/server_args.py"}


ARG_GROUPS = "sglang/srt/arg_groups/"


def _sources():
    """The source texts by key, plus ``arg_groups``: ``{path: text}`` of the server arguments' field files."""
    where = os.environ.get("DSV4_SGLANG_SOURCE")
    if where and where.endswith(".whl"):
        with zipfile.ZipFile(where) as z:
            out = {k: z.read(v).decode() for k, v in FILES.items()}
            out["arg_groups"] = {n: z.read(n).decode() for n in z.namelist()
                                 if n.startswith(ARG_GROUPS) and n.endswith(".py")}
            return out
    if where:
        root = Path(where)
    else:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("the sglang package is not installed: set DSV4_SGLANG_SOURCE to an sglang wheel "
                        "(pip download sglang --no-deps) or a folder holding the sglang package")
        root = Path(list(spec.submodule_search_locations)[0]).parent
    out = {k: (root / v).read_text(encoding="utf-8") for k, v in FILES.items()}
    out["arg_groups"] = {str(p): p.read_text(encoding="utf-8") for p in (root / ARG_GROUPS).rglob("*.py")}
    return out


@pytest.fixture(scope="module")
def schema():
    src = _sources()
    classes = {n.name: n for n in ast.walk(ast.parse(src["io"])) if isinstance(n, ast.ClassDef)}

    def fields(name):
        node = classes[name]
        out = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out |= fields(base.id)
        return out

    routes = {}
    for fn in ast.walk(ast.parse(src["http"])):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths = [d.args[0].value for d in fn.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)
                 and d.args[0].value.startswith("/")]
        body = None
        for a in fn.args.args:
            if a.arg == "obj" and a.annotation is not None:
                ann = a.annotation
                if isinstance(ann, ast.Subscript):          # Annotated[X, Body()]
                    ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                body = fields(ann.id) if isinstance(ann, ast.Name) and ann.id in classes else None
        for p in paths:
            routes[p] = body
    sampling = next(n for n in ast.walk(ast.parse(src["sampling"]))
                    if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    # a msgspec struct's annotated fields (an older sglang: the __init__ arguments)
    sampling_args = {t.target.id for t in sampling.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    for f in sampling.body:
        if isinstance(f, ast.FunctionDef) and f.name == "__init__":
            sampling_args |= {a.arg for a in f.args.args + f.args.kwonlyargs} - {"self"}
    # flags written out ("--tp-size"), and the ones argparse derives from a field name ("skip_tokenizer_init")
    flags = set()
    for name, text in [("server_args.py", src["args"]), *src["arg_groups"].items()]:
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                if n.value.startswith("--"):
                    flags.add(n.value.split("=")[0].split(" ")[0])
                elif name.endswith("field_order.py") and n.value.isidentifier():
                    flags.add("--" + n.value.replace("_", "-"))
    return routes, sampling_args, flags


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    """(path, payload) of every request the client sends in a generate / update / read / release round."""
    from tests.train._fake_sglang import FakeSGLang
    from rollout.reference_engine import SamplingParams
    from rollout.sglang_engine import SGLangEngine, SGLangServerConfig, torch_b64_serialize

    calls = []
    real = SGLangEngine._post
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SGLangEngine, "_post", lambda self, path, payload, **kw: calls.append((path, payload))
                   or real(self, path, payload, **kw))
        with FakeSGLang(CFG, tp_size=1) as fake:
            for how in ("tensors", "disk"):
                cfg = SGLangServerConfig(url=fake.url, tp_size=1, startup_timeout_s=5, request_timeout_s=5)
                kw = {"weight_update": "disk", "disk_dir": str(tmp_path_factory.mktemp("w"))} if how == "disk" else {}
                e = SGLangEngine(CFG, cfg, launch=False, serializer=torch_b64_serialize, **kw)
                e.connect()
                e.generate([[0, 5, 6]], SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3, top_k=5),
                           n=2, seed=1)
                e.release_memory()
                e.resume_memory()
                if how == "tensors":
                    e.begin_update(1)
                    e.load_bucket([("embed.weight", torch.ones(2, 2))])
                    e.finish_update()
                    e.weights_by_name("embed.weight")
    return calls


def test_every_request_uses_a_route_and_fields_sglang_defines(schema, sent):
    routes, sampling_args, _ = schema
    seen = {p for p, _ in sent}
    assert {"/generate", "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor",
            "/get_weights_by_name"} <= seen
    for path, payload in sent:
        assert path in routes, f"{path}: no such route in sglang's http_server.py"
        if routes[path] is not None:
            unknown = set(payload) - routes[path]
            assert not unknown, f"{path}: fields {sorted(unknown)} are not in sglang's request struct"
    for path, payload in sent:
        if path == "/generate":
            for sp in payload["sampling_params"]:
                unknown = set(sp) - sampling_args
                assert not unknown, f"sampling_params {sorted(unknown)} are not SamplingParams arguments"


def test_the_launch_command_uses_flags_sglang_defines(schema):
    from rollout.sglang_engine import SGLangServerConfig, server_command

    _, _, flags = schema
    cmd = server_command(SGLangServerConfig(model_path="/ckpt", port=31000, tp_size=2, dtype="bfloat16",
                                            mem_fraction_static=0.7))
    used = {a for a in cmd if a.startswith("--")}
    assert used and not used - flags, f"flags sglang's server_args.py does not define: {sorted(used - flags)}"


def test_the_schema_reader_finds_what_it_checks_against(schema):
    routes, sampling_args, flags = schema
    assert {"input_ids", "sampling_params", "return_logprob"} <= routes["/generate"]
    assert {"temperature", "max_new_tokens", "stop_token_ids"} <= sampling_args
    assert "--tp-size" in flags and "/health" in routes
