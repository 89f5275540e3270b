"""Extract the facts of SGLang's HTTP API that AgentRL relies on into ``tests/contracts/sglang_api.json``.

Not run by the test suite (it needs SGLang's source, which CI does not download); run it by hand when moving to a
new SGLang release, then review the diff of the fixture and the contract tests (``tests/test_sglang_contract.py``).
It only parses the source with :mod:`ast` (SGLang is never imported), from either

* a git directory and a commit (e.g. a clone or a fetched mirror of ``sgl-project/sglang``)::

    python tests/contracts/extract_sglang_api.py --git-dir sglang.git --commit SHA -o tests/contracts/sglang_api.json

* or a source tree holding ``sglang/`` (an unpacked wheel or sdist) or ``python/sglang/`` (a checkout)::

    pip download sglang==0.5.23 --no-deps -d /tmp/sg && unzip -q /tmp/sg/*.whl -d /tmp/sg/src
    python tests/contracts/extract_sglang_api.py --source-dir /tmp/sg/src --label "sglang 0.5.23 wheel (PyPI)"

Files read (paths inside the ``sglang`` package): ``srt/managers/io_struct.py`` (request structs, LoRA adapter
requests and their output),
``srt/sampling/sampling_params.py`` (``SamplingParams``), ``srt/entrypoints/http_server.py`` (routes, response
bodies), ``srt/managers/tokenizer_manager.py`` (``meta_info`` keys, how preferred sampling params are merged),
``srt/managers/schedule_batch.py`` (finish reasons), ``srt/utils/common.py`` (``init_custom_process_group``, the
weight-update group's recipe), ``srt/model_executor/model_runner_components/weight_updater.py`` and
``srt/weight_sync/tensor_bucket.py`` (the flattened-bucket form),
``srt/managers/scheduler_components/weight_updater.py`` (which updates need a weight-update session, optional),
``api/v1/api_types.py`` (the JSON contract gate of recent releases, optional), ``srt/entrypoints/v1_loads.py`` and
``srt/managers/load_snapshot.py`` (``/v1/loads``, optional) and the server arguments (``weight_version`` default).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

IO_STRUCT = "srt/managers/io_struct.py"
SAMPLING_PARAMS = "srt/sampling/sampling_params.py"
HTTP_SERVER = "srt/entrypoints/http_server.py"
TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"
SCHEDULE_BATCH = "srt/managers/schedule_batch.py"
API_TYPES = "api/v1/api_types.py"
V1_LOADS = "srt/entrypoints/v1_loads.py"
LOAD_SNAPSHOT = "srt/managers/load_snapshot.py"
SERVER_ARGS = ("srt/arg_groups/fields/serving.py", "srt/server_args.py")
UTILS_COMMON = "srt/utils/common.py"
WEIGHT_UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"
TENSOR_BUCKET = "srt/weight_sync/tensor_bucket.py"
SCHEDULER_WEIGHT_UPDATER = "srt/managers/scheduler_components/weight_updater.py"
VERSION_FILES = ("_version.py", "version.py")
API_V1_CLASSES = ("SamplingParams", "GenerateRequest", "GenerateResponse", "GenerateMetaInfo", "LogprobEntry",
                  "FinishStop", "FinishLength", "FinishAbort", "ErrorBody")
HTTP_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


class SourceReader:
    """Reads files of the ``sglang`` package from a git commit or a directory."""

    def __init__(self, git_dir: Path | None, commit: str | None, source_dir: Path | None):
        self.git_dir, self.commit, self.source_dir = git_dir, commit, source_dir
        self.read: list[str] = []
        if source_dir is not None:
            self.root = source_dir / "python" if (source_dir / "python" / "sglang").is_dir() else source_dir
            if not (self.root / "sglang").is_dir():
                raise SystemExit(f"{source_dir}: no sglang/ or python/sglang/ inside")

    def get(self, relative: str) -> str | None:
        """The text of ``sglang/<relative>``, or None when the file does not exist there."""
        if self.git_dir is not None:
            path = f"python/sglang/{relative}"
            done = subprocess.run(["git", "--git-dir", str(self.git_dir), "show", f"{self.commit}:{path}"],
                                  capture_output=True, text=True)
            text = done.stdout if done.returncode == 0 else None
        else:
            path = f"sglang/{relative}"
            file = self.root / path
            text = file.read_text() if file.is_file() else None
        if text is not None:
            self.read.append(path)
        return text

    def require(self, relative: str) -> ast.Module:
        text = self.get(relative)
        if text is None:
            raise SystemExit(f"sglang/{relative} not found in the source")
        return ast.parse(text)


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def literal(node: ast.expr | None) -> Any:
    """The value of a literal default, or ``repr``-like source text when it is not a literal."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def class_fields(cls: ast.ClassDef, all_classes: dict[str, ast.ClassDef]) -> dict[str, Any]:
    """Annotated class-level fields (dataclass / msgspec / pydantic style) with defaults, base classes first."""
    fields: dict[str, Any] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in all_classes:
            fields.update(class_fields(all_classes[base.id], all_classes))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
                value = next((k.value for k in value.keywords if k.arg == "default"), None)
            fields[node.target.id] = literal(value)
    return fields


def init_arguments(cls: ast.ClassDef) -> dict[str, Any] | None:
    """``__init__`` keyword arguments with defaults (older ``SamplingParams``), or None without an ``__init__``."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return None
    args = init.args.args[1:] + init.args.kwonlyargs
    defaults = [None] * (len(init.args.args) - 1 - len(init.args.defaults)) + list(init.args.defaults)
    defaults += list(init.args.kw_defaults)
    return {arg.arg: literal(default) for arg, default in zip(args, defaults, strict=True)}


def struct_fields(tree: ast.Module, name: str) -> dict[str, Any]:
    all_classes = classes(tree)
    if name not in all_classes:
        raise SystemExit(f"class {name} not found")
    return class_fields(all_classes[name], all_classes)


def dict_keys(node: ast.AST) -> set[str]:
    """String keys of every dict literal under ``node``."""
    keys: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Dict):
            keys.update(k.value for k in child.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return keys


def routes(tree: ast.Module, owner: str = "app") -> tuple[dict[str, list[str]], dict[str, str]]:
    """``{path: methods}`` of every FastAPI route of ``owner`` (the app or a router) with a constant path, and
    ``{path: handler function name}``."""
    methods: dict[str, set[str]] = {}
    handlers: dict[str, str] = {}
    for function in functions(tree).values():
        for decorator in function.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == owner):
                continue
            if not decorator.args or not isinstance(decorator.args[0], ast.Constant):
                continue
            path, kind = decorator.args[0].value, decorator.func.attr
            if kind == "api_route":
                listed = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
                found = {str(m).upper() for m in literal(listed)} if listed is not None else {"GET"}
            elif kind in HTTP_METHODS:
                found = {HTTP_METHODS[kind]}
            else:
                continue
            methods.setdefault(path, set()).update(found)
            handlers.setdefault(path, function.name)
    return {path: sorted(found) for path, found in sorted(methods.items())}, handlers


def handler_keys(tree: ast.Module, handler: str) -> list[str]:
    """Keys of the dict literals a route handler builds, following calls to other functions of the module once."""
    defined = functions(tree)
    function = defined[handler]
    keys = dict_keys(function)
    for call in ast.walk(function):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in defined:
            keys |= dict_keys(defined[call.func.id])
    return sorted(keys)


def meta_info_keys(tree: ast.Module) -> list[str]:
    """Keys written into any ``meta_info`` dict: literals assigned to it, subscript stores and ``update({...})``."""
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "meta_info" and isinstance(node.value, ast.Dict):
                    keys |= dict_keys(node.value)
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "meta_info" and isinstance(target.slice, ast.Constant)):
                    keys.add(target.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "meta_info"):
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    keys |= dict_keys(arg)
    return sorted(keys)


def preferred_params_merge(tree: ast.Module) -> str | None:
    """The source of the expression merging ``preferred_sampling_params`` with a request's ``sampling_params``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and len(node.keys) == 2 and node.keys == [None, None]:
            first, second = (ast.unparse(v) for v in node.values)
            if first.endswith("preferred_sampling_params") and second.endswith("sampling_params"):
                return ast.unparse(node)
    return None


def finish_reasons(tree: ast.Module) -> dict[str, list[str]]:
    """``{type: keys}`` of the dicts the ``FINISH_*`` classes' ``to_json`` return."""
    shapes: dict[str, set[str]] = {}
    for cls in classes(tree).values():
        if not cls.name.startswith("FINISH"):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef) and node.name == "to_json":
                for child in ast.walk(node):
                    if isinstance(child, ast.Dict):
                        entries = {k.value: v for k, v in zip(child.keys, child.values, strict=True)
                                   if isinstance(k, ast.Constant)}
                        kind = entries.get("type")
                        if isinstance(kind, ast.Constant):
                            shapes.setdefault(kind.value, set()).update(entries)
    return {kind: sorted(keys) for kind, keys in sorted(shapes.items())}


def api_v1(reader: SourceReader) -> dict[str, Any] | None:
    """The msgspec structs of ``api/v1/api_types.py``: fields and whether unknown keys are rejected."""
    text = reader.get(API_TYPES)
    if text is None:
        return None
    tree = ast.parse(text)
    all_classes = classes(tree)
    result: dict[str, Any] = {}
    for name in API_V1_CLASSES:
        cls = all_classes[name]
        doc = ast.get_docstring(cls) or ""
        match = re.search(r"unknown keys (rejected|ignored)", doc)
        result[name] = {"fields": sorted(class_fields(cls, all_classes)),
                        "unknown_keys": match.group(1) if match else None}
    return result


def loads(reader: SourceReader) -> tuple[dict[str, list[str]], dict[str, Any] | None]:
    """The routes of the ``/v1/loads`` router (recent releases; it replaced ``/get_load``) and its body: the
    response's keys and the core keys of each ``loads`` entry (``LoadSnapshot`` without its optional sections)."""
    text, snapshot = reader.get(V1_LOADS), reader.get(LOAD_SNAPSHOT)
    if text is None or snapshot is None:
        return {}, None
    tree, snapshot_tree = ast.parse(text), ast.parse(snapshot)
    route_methods, handlers = routes(tree, owner="router")
    sections = next(ast.literal_eval(node.value.args[0]) for node in snapshot_tree.body
                    if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_SECTION_FIELDS")
    core = [name for name in struct_fields(snapshot_tree, "LoadSnapshot") if name not in sections]
    return route_methods, {"response_keys": handler_keys(tree, handlers["/v1/loads"]), "core_keys": core}


def weight_version_default(reader: SourceReader) -> Any:
    for relative in SERVER_ARGS:
        text = reader.get(relative)
        if text is None:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == "weight_version":
                return literal(node.value)
    return None


def package_version(reader: SourceReader) -> str | None:
    for relative in VERSION_FILES:
        text = reader.get(relative)
        if text is None:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return str(node.value.value)
    return None


def weight_update_group(reader: SourceReader, io_struct: ast.Module, http: ast.Module,
                        handlers: dict[str, str]) -> dict[str, Any]:
    """The distributed weight update: its request structs (with defaults), response keys, how both sides build
    the process group (``init_custom_process_group``: the rendezvous, the ``PrefixStore`` prefix, the helper) and
    the flattened-bucket form (its ``load_format`` and the bucket's element type)."""
    recipe = functions(reader.require(UTILS_COMMON))["init_custom_process_group"]
    calls = {ast.unparse(c.func): c for c in ast.walk(recipe) if isinstance(c, ast.Call)}
    updater = reader.require(WEIGHT_UPDATER)
    load_formats = sorted({node.comparators[0].value for node in ast.walk(updater) if isinstance(node, ast.Compare)
                           and ast.unparse(node.left) == "load_format" and isinstance(node.comparators[0], ast.Constant)
                           and isinstance(node.comparators[0].value, str)})
    bucket = reader.require(TENSOR_BUCKET)
    views = sorted({ast.unparse(c.args[0]) for c in ast.walk(bucket) if isinstance(c, ast.Call)
                    and isinstance(c.func, ast.Attribute) and c.func.attr == "view" and c.args
                    and ast.unparse(c.args[0]).startswith("torch.")})
    return {
        "init_request": struct_fields(io_struct, "InitWeightsUpdateGroupReqInput"),
        "update_request": struct_fields(io_struct, "UpdateWeightsFromDistributedReqInput"),
        "destroy_request": struct_fields(io_struct, "DestroyWeightsUpdateGroupReqInput"),
        "tensor_request": sorted(struct_fields(io_struct, "UpdateWeightsFromTensorReqInput")),
        "response_keys": {path: handler_keys(http, handlers[path]) for path in (
            "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
            "/update_weights_from_tensor")},
        "process_group": {"prefix_store_prefix": ast.unparse(calls["PrefixStore"].args[0]),
                          "rendezvous": "rendezvous" in calls,
                          "helper": "_new_process_group_helper" if "_new_process_group_helper" in calls else None},
        "distributed_load_formats": load_formats,
        "bucket_element_views": views,
    }


def weight_update_session(reader: SourceReader, io_struct: ast.Module, http: ast.Module,
                          handlers: dict[str, str]) -> dict[str, Any]:
    """The weight-update session of recent releases (``/begin_weight_update`` ... ``/end_weight_update``): its
    requests, answers, and the updates that refuse to run outside one (the scheduler's weight-updater methods that
    check ``self._session is None``); ``required_by`` is empty where there is no session."""
    text = reader.get(SCHEDULER_WEIGHT_UPDATER)
    if text is None or "/begin_weight_update" not in handlers:
        return {"required_by": []}
    def checks_session(function: ast.FunctionDef) -> bool:
        return any(isinstance(n, ast.Compare) and ast.unparse(n) == "self._session is None"
                   for n in ast.walk(function))

    required = sorted(f"/{f.name}" for f in ast.walk(ast.parse(text)) if isinstance(f, ast.FunctionDef)
                      and f.name.startswith("update_weights_from") and checks_session(f))
    return {
        "begin_request": struct_fields(io_struct, "BeginWeightUpdateReqInput"),
        "end_request": struct_fields(io_struct, "EndWeightUpdateReqInput"),
        "response_keys": {path: handler_keys(http, handlers[path]) for path in (
            "/begin_weight_update", "/end_weight_update")},
        "required_by": required,
    }


def extract(reader: SourceReader, label: str | None) -> dict[str, Any]:
    io_struct = reader.require(IO_STRUCT)
    sampling = classes(reader.require(SAMPLING_PARAMS))["SamplingParams"]
    sampling_fields = init_arguments(sampling) or class_fields(sampling, {})
    http = reader.require(HTTP_SERVER)
    tokenizer_manager = reader.require(TOKENIZER_MANAGER)
    route_methods, handlers = routes(http)
    load_routes, load_body = loads(reader)
    facts: dict[str, Any] = {
        "generate_request_fields": sorted(struct_fields(io_struct, "GenerateReqInput")),
        "sampling_params": {"fields": sorted(sampling_fields), "defaults": sampling_fields},
        "update_weights_from_disk": {
            "request_fields": sorted(struct_fields(io_struct, "UpdateWeightFromDiskReqInput")),
            "output_fields": sorted(struct_fields(io_struct, "UpdateWeightFromDiskReqOutput")),
            "response_keys": handler_keys(http, handlers["/update_weights_from_disk"]),
        },
        "memory_occupation_request_fields": {
            "release": sorted(struct_fields(io_struct, "ReleaseMemoryOccupationReqInput")),
            "resume": sorted(struct_fields(io_struct, "ResumeMemoryOccupationReqInput")),
        },
        "weight_update_group": weight_update_group(reader, io_struct, http, handlers),
        "weight_update_session": weight_update_session(reader, io_struct, http, handlers),
        "lora": {
            "load_request_fields": sorted(struct_fields(io_struct, "LoadLoRAAdapterReqInput")),
            "unload_request_fields": sorted(struct_fields(io_struct, "UnloadLoRAAdapterReqInput")),
            "update_output_fields": sorted(struct_fields(io_struct, "LoRAUpdateOutput")),
        },
        "routes": dict(sorted({**route_methods, **load_routes}.items())),
        "loads": load_body,
        "model_info_keys": handler_keys(http, handlers["/get_model_info"]),
        "meta_info_keys": meta_info_keys(tokenizer_manager),
        "finish_reasons": finish_reasons(reader.require(SCHEDULE_BATCH)),
        "preferred_sampling_params_merge": preferred_params_merge(tokenizer_manager),
        "weight_version_default": weight_version_default(reader),
        "api_v1": api_v1(reader),
    }
    source = {"label": label, "git_commit": reader.commit, "package_version": package_version(reader),
              "files": sorted(set(reader.read))}
    return {"source": source, **facts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--git-dir", type=Path, help="git directory of sgl-project/sglang (with --commit)")
    where.add_argument("--source-dir", type=Path, help="directory holding sglang/ or python/sglang/")
    parser.add_argument("--commit", help="commit to read from --git-dir")
    parser.add_argument("--label", help="where the source came from (recorded in the fixture)")
    parser.add_argument("-o", "--output", type=Path, help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    if args.git_dir is not None and not args.commit:
        parser.error("--git-dir needs --commit")
    reader = SourceReader(args.git_dir, args.commit, args.source_dir)
    text = json.dumps(extract(reader, args.label), indent=2, sort_keys=True, default=str) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
