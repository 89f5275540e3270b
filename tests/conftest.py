"""Shared fixtures: a real MongoDB-protocol server process for the whole session.

By default the embedded NX-27017 server is started on a free port in a temporary directory. ``--mongo-server
secantus`` starts a SecantusDB server instead (``secantus_fixtures.py``); ``--also-secantus`` (``scripts/test.sh``)
runs the store and resume tests on both, each test that uses a database once per server. Set
``AGENTRL_TEST_MONGO_URI`` (e.g. ``mongodb://localhost:27017``) to run the same tests against another server, such
as a real MongoDB. Each test gets its own database name, so tests never see each other's data.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pymongo import MongoClient
from pymongo.uri_parser import parse_uri

from agentrl.log import StderrHandler
from agentrl.store.embedded import EmbeddedServer

try:
    from _pytest.nodeid import NodeId  # pytest >= 9
except ImportError:  # older pytest reads item._nodeid, which xdist sets itself
    NodeId = None

# shared session fixtures (tiny models, engines, the SecantusDB server)
pytest_plugins = ["inference_fixtures", "rollout_fixtures", "env_fixtures", "secantus_fixtures", "example_fixtures",
                  "emulated_kernels"]

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _no_log_handler_left_behind() -> Iterator[None]:
    """A run started in the test's process (``agentrl.train.main``, the CLI's ``main``) sets up the root logger's
    stderr handler (``agentrl.log.setup_logging``); it goes with the test, so that a record a background thread
    writes later is not printed outside any test, and the next in-process run sets up its own."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(handler)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--mongo-server", choices=["embedded", "secantus"], default="embedded",
                     help="the server that mongo_server_uri starts: NX-27017 (default) or SecantusDB "
                          "(AGENTRL_TEST_MONGO_URI, when set, names a running server instead)")
    parser.addoption("--also-secantus", action="store_true",
                     help="run the store and resume tests that use a database on NX-27017 and again on SecantusDB")
    parser.addoption("--cpu-report", action="store_true",
                     help="print the CPU time of each test module, its own and its child processes' (cpu_report.py)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--cpu-report"):
        import cpu_report

        config.pluginmanager.register(cpu_report, "cpu_report")
    if os.environ.get("AGENTRL_TEST_MONGO_URI") and config.getoption("--mongo-server") != "embedded":
        raise pytest.UsageError("--mongo-server and AGENTRL_TEST_MONGO_URI both name a server: use one")
    if config.getoption("--also-secantus") and (os.environ.get("AGENTRL_TEST_MONGO_URI")
                                                or config.getoption("--mongo-server") != "embedded"):
        raise pytest.UsageError("--also-secantus runs on both servers: it takes neither --mongo-server nor "
                                "AGENTRL_TEST_MONGO_URI")


def on_both_servers(module: str) -> bool:
    """The modules ``--also-secantus`` runs on SecantusDB too: the store's (every command the other processes send
    goes through it), but for the one that uses SecantusDB's failpoints itself, and the trainer's resume."""
    return (module.startswith("test_store_") and module != "test_store_secantus_faults") or \
        module == "test_trainer_resume"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (metafunc.config.getoption("--also-secantus") and "mongo_server_uri" in metafunc.fixturenames
            and on_both_servers(metafunc.module.__name__)):
        metafunc.parametrize("mongo_server_uri", ["embedded", "secantus"], indirect=True, scope="session")


# Session fixtures that take a minute or more to build: under ``pytest -n N --dist loadgroup`` (scripts/test.sh) the
# tests that use one run on the same worker, so it is built once.
SHARED_ON_ONE_WORKER = ("minirl_example_run",)
WHOLE_RUN_TIMEOUT_S = 900
"""The timeout of a test that uses ``minirl_example_run``: the first one builds the scripted model and runs the whole
example script in its setup (on a fresh clone, under the suite's load: more than the default 300 s)."""
TRAINED_VLM_FIXTURES = ("scripted_vision_model_dir", "babyai_vision_model_dir")
TRAINED_VLM_TIMEOUT_S = 600
"""The timeout of a test whose fixture trains a tiny VLM in its setup: 197-270 s of setup alone under the suite's
load on a slow 2-core EPYC (one test failed at the default 300 s)."""
# A module of 10 s or more on one worker (measured; its tests start engines, samplers, trainers) says so itself:
# ``pytestmark = pytest.mark.slow``, so that ``./scripts/test.sh -m "not slow"`` runs the rest, about 550 tests, in
# under 5 minutes. Those of a minute or more add ``start_rank`` (``pytest.mark.slow(start_rank=N)``): they start
# first, the lowest rank first, so that the workers end together.


def uses_module_fixture(item: pytest.Item) -> bool:
    """Whether one of the fixtures ``item`` uses is module-, package- or class-scoped (built once per such scope and
    worker: its tests should share a worker)."""
    definitions = getattr(item, "_fixtureinfo", None)
    return definitions is not None and any(
        defs[-1].scope in ("module", "package", "class") for defs in definitions.name2fixturedefs.values() if defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """For ``--dist loadgroup``: the tests of a module with a module-scoped fixture stay on one worker (the fixture
    is built once), as do all tests of a fixture in ``SHARED_ON_ONE_WORKER``; every other test goes to whichever
    worker is free. The modules with a ``start_rank`` come first. An explicit ``xdist_group`` mark wins."""
    def rank(item: pytest.Item) -> float:
        slow = item.get_closest_marker("slow")
        return slow.kwargs.get("start_rank", math.inf) if slow is not None else math.inf

    items.sort(key=rank)  # stable: the order within a module stays
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shared = next((name for name in SHARED_ON_ONE_WORKER if name in item.fixturenames), None)
            if shared or uses_module_fixture(item):
                item.add_marker(pytest.mark.xdist_group(shared or item.module.__name__))
        if "minirl_example_run" in item.fixturenames and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(WHOLE_RUN_TIMEOUT_S))
        elif set(TRAINED_VLM_FIXTURES) & set(item.fixturenames) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TRAINED_VLM_TIMEOUT_S))
        if config.getoption("loadgroup", False) and (group := item.get_closest_marker("xdist_group")) is not None:
            group_node_id(item, str(group.args[0] if group.args else group.kwargs.get("name", "default")))


def group_node_id(item: pytest.Item, group: str) -> None:
    """``NODE_ID@GROUP``, the node id by which xdist's ``loadgroup`` sends a group's tests to one worker. xdist 3.8
    writes it to ``item._nodeid``, which pytest 9 no longer reads (the id is ``item._id``), so without this every
    test is scheduled alone and each worker builds the module fixtures again."""
    if NodeId is not None and "@" not in item.nodeid:
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.fixture(scope="session")
def mongo_server_uri(request: pytest.FixtureRequest) -> str:
    """Connection string (no database) of the session's server (of the test's, under ``--also-secantus``)."""
    external = os.environ.get("AGENTRL_TEST_MONGO_URI")
    if external:
        return external
    if getattr(request, "param", request.config.getoption("--mongo-server")) == "secantus":
        return request.getfixturevalue("secantus_server_uri")
    return request.getfixturevalue("embedded_server_uri")


@pytest.fixture(scope="session")
def embedded_server_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Connection string (no database) of the session's NX-27017 server, one for every test that uses it."""
    server = EmbeddedServer(data_dir=Path(tmp_path_factory.mktemp("nx27017")), port=free_port())
    server.start()
    try:
        yield server.uri()
    finally:
        server.stop()


def with_database(server_uri: str, database: str) -> str:
    """``server_uri`` with its path (the database name) replaced by ``database``."""
    head, _, query = server_uri.partition("?")
    scheme, _, rest = head.partition("://")
    hosts = rest.split("/", 1)[0]
    return f"{scheme}://{hosts}/{database}" + (f"?{query}" if query else "")


@pytest.fixture
def db_uri(mongo_server_uri: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A connection string whose database is fresh for this test (dropped afterwards)."""
    name = "t_" + uuid.uuid4().hex[:12]
    uri = with_database(mongo_server_uri, name)
    yield uri
    client: MongoClient = MongoClient(mongo_server_uri)
    try:
        client.drop_database(name)
    finally:
        client.close()


@pytest.fixture
def db_name(db_uri: str) -> str:
    return parse_uri(db_uri)["database"]
