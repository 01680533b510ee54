"""A torch-free DHT reader for the monitor: hivemind's own ``DHTNode`` and ``p2pd``, without ``import torch``.

Importing anything from hivemind runs ``hivemind/__init__.py``, which imports the averager, the MoE code
and with them torch: about 220 MB of resident memory before a single record is read. The DHT itself
(``hivemind.dht.node``, ``hivemind.p2p``, the validators) needs none of it; only the package
``__init__`` files pull it in. :func:`load_dht_modules` registers bare package objects for ``hivemind``,
``hivemind.utils``, ``hivemind.p2p`` and ``hivemind.dht`` and fills in just the names the DHT modules
import from them, so the real leaf modules load unchanged.

This is for processes that only read the DHT (``collab monitor``). It must run before anything else
imports hivemind in that process: once the real package is loaded the bare one cannot replace it (and is
not needed). :class:`DhtReader` runs a client-mode ``DHTNode`` on a background asyncio loop in this
process (no forked DHT process, no shared-memory manager).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Package -> (module, names) that hivemind's DHT modules import from the package itself (hivemind 1.1.x).
_PACKAGE_NAMES: dict[str, list[tuple[str, list[str]]]] = {
    "hivemind.utils": [
        ("hivemind.utils.logging", ["get_logger"]),
        ("hivemind.utils.serializer", ["MSGPackSerializer", "SerializerBase"]),
        ("hivemind.utils.timed_storage", ["get_dht_time", "DHTExpiration", "ValueWithExpiration"]),
    ],
    "hivemind.p2p": [
        ("hivemind.p2p.p2p_daemon", ["P2P", "P2PContext"]),
        ("hivemind.p2p.p2p_daemon_bindings", ["P2PDaemonError", "P2PHandlerError", "PeerID", "PeerInfo"]),
        ("hivemind.p2p.servicer", ["ServicerBase", "StubBase"]),
    ],
}


def _bare_package(name: str, path: Path) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(path)]
    sys.modules[name] = module
    return module


def load_dht_modules() -> None:
    """Make ``hivemind.dht.node`` and friends importable without torch (see the module docstring).

    A no-op when the real hivemind package is already imported.
    """
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("hivemind is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    _bare_package("hivemind", root)
    for package in ("hivemind.utils", "hivemind.p2p", "hivemind.dht"):
        _bare_package(package, root / package.split(".", 1)[1])
    for package, sources in _PACKAGE_NAMES.items():
        target = sys.modules[package]
        for module_name, names in sources:
            module = importlib.import_module(module_name)
            for n in names:
                setattr(target, n, getattr(module, n))


class DhtReader:
    """A client-mode DHT node in this process that reads dictionary records.

    Args:
        initial_peers: multiaddrs of any peers of the run.
        record_validators: hivemind record validators (signatures, schema); records failing them are dropped.
        host: address the local ``p2pd`` listens on (client mode: it accepts no inbound DHT traffic).
        start_timeout_s: how long joining the DHT may take.
        authorizer: for invite-only runs, a :class:`~collab.swarm.access.SwarmAuthorizer`.

    Example::

        reader = DhtReader(["/ip4/127.0.0.1/tcp/4100/p2p/12D3..."], record_validators=validators)
        records = reader.get_dict("run_progress", timeout_s=15.0)
        reader.shutdown()
    """

    def __init__(
        self,
        initial_peers: Sequence[str],
        *,
        record_validators: Sequence[Any] = (),
        host: str = "127.0.0.1",
        start_timeout_s: float = 60.0,
        authorizer: Any = None,
    ) -> None:
        load_dht_modules()
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import CompositeValidator

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="collab-dht-reader", daemon=True)
        self._thread.start()
        validator = CompositeValidator(list(record_validators)) if record_validators else None
        try:
            self.node = self.run(
                DHTNode.create(
                    initial_peers=list(initial_peers),
                    client_mode=True,
                    record_validator=validator,
                    authorizer=authorizer,
                    host_maddrs=[f"/ip4/{host}/tcp/0"],
                    ensure_bootstrap_success=True,
                ),
                timeout_s=start_timeout_s,
            )
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def get_dict(self, key: str, *, timeout_s: float) -> dict[str, Any]:
        """``{subkey: value}`` of a dictionary key, latest values (empty if absent or expired)."""
        found = self.run(self.node.get(key, latest=True), timeout_s=timeout_s)
        if found is None or not hasattr(found.value, "items"):
            return {}
        return {str(sub): item.value for sub, item in found.value.items()}

    def shutdown(self) -> None:
        """Leave the DHT and stop ``p2pd``."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            self.run(self.node.shutdown(), timeout_s=10.0)
        except Exception as e:  # shutting down: report, carry on
            logger.debug("dht reader shutdown: %s", e)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()
