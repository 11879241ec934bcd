"""The names the server answers to: the base model (and its aliases) and the LoRA adapters.

``OpenAIServingModels`` maps a request's ``"model"`` to ``None`` (the base model) or the
adapter's ``LoRARequest``, lists ``/v1/models``, and loads / unloads adapters at run time
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

Adapter ids are given by the server: 1, 2, ... in load order, never reused within a process
(so a name loaded again after an unload is a new adapter to the engine and its prefix cache).

Adapter names follow ``field_limits.LORA_NAME_RULE`` wherever they enter (``--lora-modules``,
``/v1/load_lora_adapter``, a request's ``model``). A run-time load's ``lora_path`` that is not a
readable adapter directory gets one message whatever the reason (missing, not a directory, no
adapter files, unreadable, an adapter file that is not a regular file), so the endpoint cannot be
used to learn which paths exist (the reason goes to the server log); with ``allowed_lora_root``
(``--allowed-lora-root``) only directories under that root, and adapter files that resolve under
it too, symlinks resolved, may be loaded at run time (checked again each time the engine reads
them).

Unloading an adapter that requests are using: the name goes at once (new requests naming it
get 404; a request admitted before the unload but not yet queued is refused with that 404),
the requests already in the engine finish with it, and the engine drops its weights when the
last of them ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.async_llm_engine import EngineDeadError
from kvserve.entrypoints.openai.errors import APIError, quoted
from kvserve.field_limits import LORA_NAME_RULE, lora_name_ok
from kvserve.lora.modules import LoRAModulePath, parse_lora_module  # noqa: F401 (re-exported)
from kvserve.lora.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterFileError
from kvserve.lora_request import LoRARequest

logger = logging.getLogger("kvserve.server")


@dataclass
class _Adapter:
    request: LoRARequest
    parent: str
    users: int = 0  # engine requests in flight with it
    unloaded: bool = False  # name gone; the engine drops it when ``users`` reaches 0


class OpenAIServingModels:
    """The served names and the loaded LoRA adapters of one server.

    Args:
        async_engine: the ``AsyncLLMEngine`` (its ``engine.lora_config`` is None when LoRA is
            off).
        base_model_names: the names of the base model (the first is reported; the others,
            e.g. the model path, are accepted as aliases).
        model_root: ``root`` of the base model's card (its path).
        allowed_lora_root: when set, ``load_lora_adapter`` loads only directories under it
            (symlinks resolved); None: any directory the server can read.

    Raises:
        ValueError: ``allowed_lora_root`` is not an existing directory.
    """

    def __init__(
        self,
        async_engine,
        base_model_names: Sequence[str],
        model_root: str | None = None,
        allowed_lora_root: str | None = None,
    ):
        self.async_engine = async_engine
        self.base_model_names = list(base_model_names)
        self.model_root = model_root
        self.allowed_lora_root: str | None = None
        if allowed_lora_root is not None:
            if not os.path.isdir(allowed_lora_root):
                raise ValueError(f"--allowed-lora-root {allowed_lora_root!r} is not a directory.")
            self.allowed_lora_root = os.path.realpath(allowed_lora_root)
        self._adapters: dict[str, _Adapter] = {}
        self._by_id: dict[int, _Adapter] = {}  # includes unloaded ones still in use
        self._loading: set[str] = set()
        self._next_id = 1

    # ------------------------------------------------------------------ facts
    @property
    def base_model_name(self) -> str:
        """The reported base model name."""
        return self.base_model_names[0]

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine was started with LoRA (``--enable-lora``)."""
        return self.async_engine.engine.lora_config is not None

    def adapters(self) -> list[tuple[LoRARequest, str]]:
        """The loaded adapters (load order) with the ``parent`` each reports."""
        return [(a.request, a.parent) for a in self._adapters.values()]

    def num_adapters(self) -> int:
        """How many adapters are loaded (by name)."""
        return len(self._adapters)

    # ------------------------------------------------------------------ requests
    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model, no name, or ``""``,
        which vLLM also answers with the served model).

        Raises:
            APIError: 404 ``model_not_found`` for any other name (the name quoted cut short;
                one no adapter could have, ``LORA_NAME_RULE``, is told so).
        """
        if not name or name in self.base_model_names:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            raise self._not_found(name)
        return adapter.request

    def _not_found(self, name: str) -> APIError:
        known = [self.base_model_name] + list(self._adapters)
        listed = ", ".join(repr(n) for n in known[:20]) + (
            f" and {len(known) - 20} more" if len(known) > 20 else ""
        )
        rule = "" if lora_name_ok(name) else f" (a LoRA adapter name is {LORA_NAME_RULE})"
        return APIError(
            f"The model {quoted(name, 64)} does not exist{rule}; this server serves {listed}.",
            404,
            param="model",
            code="model_not_found",
        )

    def acquire(self, lora_request: LoRARequest, n: int = 1) -> None:
        """Count ``n`` engine requests about to run with ``lora_request`` (released one by
        one with ``release``), so an unload waits for them.

        Raises:
            APIError: 404 when the adapter was unloaded since the request named it.
        """
        adapter = self._by_id.get(lora_request.lora_int_id)
        if adapter is None or adapter.unloaded:
            raise APIError(
                f"The model '{lora_request.lora_name}' was unloaded before this request could start.",
                404,
                param="model",
                code="model_not_found",
            )
        adapter.users += n

    def release(self, lora_request: LoRARequest) -> None:
        """One engine request with ``lora_request`` ended (it is out of the engine, or its
        abort is queued before anything this queues). The last user of an unloaded adapter
        has the engine drop it."""
        adapter = self._by_id.get(lora_request.lora_int_id)
        if adapter is None:
            return
        adapter.users = max(0, adapter.users - 1)
        if adapter.unloaded and adapter.users == 0:
            self._drop(adapter)

    def _drop(self, adapter: _Adapter) -> asyncio.Future:
        self._by_id.pop(adapter.request.lora_int_id, None)
        future = self.async_engine.submit(self.async_engine.engine.remove_lora, adapter.request.lora_int_id)
        future.add_done_callback(_log_failure)
        return future

    # ------------------------------------------------------------------ load / unload
    def _check_new_name(self, name: str) -> None:
        if not lora_name_ok(name):
            raise APIError(
                f"lora_name must be {LORA_NAME_RULE}, got {quoted(name, 64)}.",
                400,
                param="lora_name",
                code="invalid_value",
            )
        if name in self.base_model_names:
            raise APIError(
                f"lora_name {name!r} is the base model's name; choose another.",
                400,
                param="lora_name",
                code="invalid_value",
            )
        if name in self._adapters or name in self._loading:
            raise APIError(
                f"The LoRA adapter {name!r} is already loaded (or being loaded); unload it first.",
                400,
                param="lora_name",
                code="lora_already_loaded",
            )

    def _disabled(self) -> APIError:
        return APIError(
            "LoRA is not enabled on this server; start it with --enable-lora to load adapters.",
            400,
            param="lora_name",
            code="lora_not_enabled",
        )

    def _new_request(self, name: str, path: str, allowed_root: str | None = None) -> LoRARequest:
        lora_id = self._next_id
        self._next_id += 1  # never reused, even when the load fails
        try:
            return LoRARequest(name, lora_id, path, allowed_root)
        except ValueError as e:
            param = "lora_name" if "lora_name" in str(e) else "lora_path"
            raise APIError(str(e), 400, param=param, code="invalid_value") from None

    def _register(self, req: LoRARequest, parent: str | None) -> None:
        adapter = _Adapter(req, parent or self.base_model_name)
        self._adapters[req.lora_name] = adapter
        self._by_id[req.lora_int_id] = adapter

    def load_startup(self, modules: Sequence[LoRAModulePath]) -> None:
        """Load the ``--lora-modules`` adapters (validated), before the engine loop runs.

        Raises:
            ValueError: LoRA is off, a name is repeated or the base model's, or an adapter
                does not load (the message names the module, and the path or the limit).
        """
        if modules and not self.lora_enabled:
            raise ValueError("--lora-modules needs --enable-lora (LoRA is off).")
        for m in modules:
            try:
                self._check_new_name(m.name)
                req = self._new_request(m.name, m.path)
                self.async_engine.engine.add_lora(req)
            except (APIError, ValueError) as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e}") from None
            self._register(req, m.base_model_name)
            logger.info("LoRA adapter %r loaded from %r (id %d)", m.name, m.path, req.lora_int_id)

    def _checked_path(self, path: str) -> str:
        """The path a run-time load reads: ``path`` itself, or its resolved form under
        ``allowed_lora_root`` (so a symlink swapped after the check cannot redirect it).

        Raises:
            APIError: 400 ``invalid_lora_adapter`` naming ``lora_path``: outside the allowed
                root (by the path as written), or not a readable adapter directory (one message
                for every reason, symlinks out of the root included).
        """
        root = self.allowed_lora_root
        if root is not None:
            lexical = os.path.normpath(os.path.join(root, path))
            if os.path.commonpath([root, lexical]) != root:
                raise APIError(
                    f"lora_path {quoted(path, 256)} is outside the allowed LoRA root {root!r}.",
                    400,
                    param="lora_path",
                    code="invalid_lora_adapter",
                )
        not_loadable = self._not_loadable(path)
        try:
            real = os.path.realpath(os.path.join(root, path) if root is not None else path)
            if root is not None and os.path.commonpath([root, real]) != root:
                raise not_loadable
            if not os.path.isdir(real):
                raise not_loadable
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                # each file resolved on its own: a symlinked file may point out of the root, or
                # at a FIFO or device whose read would hold the engine thread for good
                f = os.path.realpath(os.path.join(real, name))
                if root is not None and os.path.commonpath([root, f]) != root:
                    raise not_loadable
                if not stat.S_ISREG(os.stat(f).st_mode) or not os.access(f, os.R_OK):
                    raise not_loadable
        except (OSError, ValueError):
            raise not_loadable from None
        return real if root is not None else path

    def _not_loadable(self, path: str) -> APIError:
        """The one answer for a run-time ``lora_path`` that is not a loadable adapter directory."""
        root = self.allowed_lora_root
        where = f" under the allowed LoRA root {root!r}" if root is not None else ""
        return APIError(
            f"lora_path {quoted(path, 256)} is not a loadable LoRA adapter: it must be a directory"
            f"{where} holding {CONFIG_FILE} and {WEIGHTS_FILE} (regular files{where}), readable by "
            "the server.",
            400,
            param="lora_path",
            code="invalid_lora_adapter",
        )

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """``POST /v1/load_lora_adapter``: read and validate the adapter (on the engine
        thread, between steps), then serve it under ``name``.

        Raises:
            APIError: 400 when LoRA is off, ``name`` is invalid or taken, ``path`` is not a
                readable adapter directory (under ``allowed_lora_root`` when set), or the
                adapter is invalid (the message names the limit, e.g. ``max_lora_rank``).
        """
        if not self.lora_enabled:
            raise self._disabled()
        self._check_new_name(name)
        req = self._new_request(name, self._checked_path(path), self.allowed_lora_root)
        self._loading.add(name)  # a concurrent load of the same name is refused meanwhile
        try:
            await self.async_engine.add_lora(req)
        except AdapterFileError as e:
            # changed since ``_checked_path`` (or a check only the reader makes): the same
            # answer as any other path that is not an adapter; the reason is for the operator
            logger.warning("LoRA adapter %r not loaded from %r: %s", name, req.lora_path, e)
            raise self._not_loadable(path) from None
        except ValueError as e:
            raise APIError(str(e), 400, param="lora_path", code="invalid_lora_adapter") from None
        except EngineDeadError as e:
            raise APIError(str(e), 503, type="service_unavailable", code="engine_dead") from None
        finally:
            self._loading.discard(name)
        self._register(req, None)
        logger.info("LoRA adapter %r loaded from %r (id %d)", name, req.lora_path, req.lora_int_id)
        return req

    async def unload_lora_adapter(self, name: str) -> tuple[LoRARequest, int]:
        """``POST /v1/unload_lora_adapter``: stop serving ``name``; the engine drops the
        weights now, or when the last request running with them ends.

        Returns:
            The adapter, and how many engine requests were still running with it.

        Raises:
            APIError: 400 when LoRA is off, 404 when no adapter has that name.
        """
        if not self.lora_enabled:
            raise self._disabled()
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise APIError(
                f"The LoRA adapter {name!r} is not loaded.", 404, param="lora_name", code="lora_not_found"
            )
        adapter.unloaded = True
        users = adapter.users
        if users == 0:
            await self._drop(adapter)
        logger.info(
            "LoRA adapter %r unloaded (id %d%s)",
            name,
            adapter.request.lora_int_id,
            f"; {users} running request(s) finish with it" if users else "",
        )
        return adapter.request, users


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("removing a LoRA adapter from the engine failed: %r", future.exception())
