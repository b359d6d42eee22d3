"""A real two-node Ray cluster on 127.0.0.1 for the tests of carrack.ray: a head and a second node process, one
CPU each, started with `ray start` and connected to with ray.init(address=...).

Stopping it kills only the processes of this cluster (found by its own temp dir in their command lines): `ray stop
--force` would kill every Ray process of the machine, other people's clusters included."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# a token of this cluster's own: its nodes and this driver authenticate with it (Ray's token mode); the driver
# reads it when ray is imported
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
os.environ.update(RAY_USAGE_STATS_ENABLED="0", **AUTH)

ray = pytest.importorskip("ray", reason="Ray Data is not installed: pip install 'carrack[ray]'")


def _only_loopback() -> bool:
    """Whether this process sees no network interface but loopback (a private network namespace)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def pytest_collection_modifyitems(config, items) -> None:
    """Ray probes public resolvers to pick its node address and binds the host's interfaces: its clusters are
    started only where nothing but loopback exists."""
    if _only_loopback():
        return
    skip = pytest.mark.skip(reason="the Ray tests run in a network namespace with only loopback: unshare --net sh "
                                   "-c 'ip link set lo up && python -m pytest tests/ray' (as .ci/run does)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'carrack[ray]'")

ROOT = Path(__file__).resolve().parents[2]
OBJECT_STORE_BYTES = 96 * 2**20
START_TIMEOUT_S = 120
STOP_GRACE_S = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> list[str]:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if exe is None:
        pytest.skip("the 'ray' command is not on PATH")
    return [exe]


def cluster_env() -> dict[str, str]:
    """Ray's processes import carrack (and tests.ray.udfs) from this checkout."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, RAY_USAGE_STATS_ENABLED="0", **AUTH)


def _start(args: list[str], temp_dir: str) -> None:
    cmd = _ray_cli() + ["start", *args, "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
                        "--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", temp_dir,
                        "--disable-usage-stats"]
    done = subprocess.run(cmd, env=cluster_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


def _own_processes(marker: str) -> list[int]:
    """Pids of processes whose command line names this cluster's temp dir."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def stop_cluster(temp_dir: str) -> None:
    """SIGTERM this cluster's processes, SIGKILL what is left after STOP_GRACE_S."""
    deadline = time.monotonic() + STOP_GRACE_S
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _own_processes(temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        while _own_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _own_processes(temp_dir):
            break
        deadline = time.monotonic() + 5


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a running head + worker node cluster, this process connected to it."""
    temp_dir = tempfile.mkdtemp(prefix="crkray-", dir="/tmp")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    try:
        _start(["--head", "--port", str(port), "--include-dashboard=false"], temp_dir)
        _start(["--address", address], temp_dir)
        ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="WARNING")
        _wait_for_nodes(2)
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_nodes(count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray cluster has {sum(n['Alive'] for n in ray.nodes())} live nodes, not {count}")
        time.sleep(0.5)
