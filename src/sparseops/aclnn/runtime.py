"""The two-phase runtime under every ``aclnn`` operator: status codes, the executor, the workspace rules,
error messages, the CANN-layer argument checks and the context options (docs/aclnn.md).

An operator is written once as its phase-1 function decorated with :func:`phase1`: it checks its arguments
(raising :class:`Fail` or letting a shared check's ``ValueError`` / ``TypeError`` through) and returns a
:class:`Plan`; :func:`phase2` makes the matching phase-2 function. Nothing here raises to the caller.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _config

ACLNN_SUCCESS = 0
#: a required input tensor, out tensor or the executor is None (C: a null pointer)
ACLNN_ERR_PARAM_NULLPTR = 161001
#: unsupported dtype / format / layout; float64; int64 sortedIndices / topkIndices; bad executor or workspace
ACLNN_ERR_PARAM_INVALID = 161002
#: unexpected failure while computing (C: a runtime call failed)
ACLNN_ERR_RUNTIME_ERROR = 361001
#: shape or attribute constraint (K > 512, bad range, block size, sparse mode, out shape, ...)
ACLNN_ERR_INNER_TILING_ERROR = 561002

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
#: ``aclSysParamOpt`` value of the determinism switch (acl_base.h)
ACL_OPT_DETERMINISTIC = 0

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_NAMES = "FLOAT, FLOAT16, BFLOAT16"

_tls = threading.local()


def aclGetRecentErrMsg() -> str | None:  # noqa: N802 (CANN's name)
    """The text of the last failure of an ``aclnn*`` call in this thread; None when the last call succeeded."""
    return getattr(_tls, "msg", None)


class Fail(Exception):
    """A check of the CANN layer failed: ``status`` and the message :func:`aclGetRecentErrMsg` returns."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status
        self.msg = msg


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def fmt_shape(t) -> str:
    return "[" + ", ".join(str(int(s)) for s in t) + "]"


def _record(api: str, status: int, msg: str) -> int:
    _tls.msg = f"{api} failed with status {status}: {msg}"
    return status


def python_error(exc: BaseException, names: dict[str, str]) -> tuple[int, str]:
    """Status and message for an exception raised by a Python op's argument checks. The Python message
    starts with the argument's Python name; put the CANN name in front of it."""
    msg = str(exc)
    head = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", msg)
    cann = names.get(head.group(1)) if head else None
    text = f"{cann}: {msg}" if cann and cann != head.group(1) else msg  # no "key: key: ..."
    status = ACLNN_ERR_PARAM_INVALID if isinstance(exc, TypeError) else ACLNN_ERR_INNER_TILING_ERROR
    return status, text


def validate(names: dict[str, str], fn, *args, **kwargs):
    """Run a shared check or a Python op's validator (no computing); its ValueError / TypeError becomes a
    :class:`Fail` whose message carries the CANN name of the argument (``names``: Python -> CANN)."""
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise Fail(*python_error(exc, names)) from None


# The plan of phase 1, the executor, the two phases


@dataclass
class Plan:
    """What phase 1 hands to phase 2.

    Args:
        call: runs the Python op (``validate=False``: phase 1 ran every check); returns its result or results.
        outs: the caller's out tensors, CANN name -> tensor or None (a result not asked for), in the order of
            the op's results. A result with fewer rows than its out tensor fills the leading rows, the rest
            become zeros.
        names: the op's Python argument names -> CANN names, for messages.
        workspace_size: bytes of the temporary results phase 2 allocates before copying them into the outs.
        device: the device of the tensors.
    """

    call: Callable[[], object]
    outs: dict[str, torch.Tensor | None]
    names: dict[str, str]
    workspace_size: int
    device: torch.device

    def __post_init__(self):
        self._shapes = {n: (tuple(t.shape), t.dtype, t.device) for n, t in self.outs.items() if t is not None}
        # two outs in the same memory: one result would silently overwrite the other
        spans = [(n, _byte_span(t)) for n, t in self.outs.items() if t is not None and t.numel()]
        for i, (a, (sa, lo_a, hi_a)) in enumerate(spans):
            for b, (sb, lo_b, hi_b) in spans[i + 1:]:
                if sa == sb and lo_a < hi_b and lo_b < hi_a:
                    raise Fail(ACLNN_ERR_PARAM_INVALID, f"{b}: expected memory apart from {a}'s, got an out tensor "
                               "that overlaps it")

    def run(self) -> None:
        """The op into the out tensors. The outs' shape, dtype and device are checked again first (phase 1
        checked them; a tensor resized between the phases would otherwise fail half-way through the copies,
        after some outs were written)."""
        for name, (shape, dtype, device) in self._shapes.items():
            t = self.outs[name]
            now = (tuple(t.shape), t.dtype, t.device)
            if now != (shape, dtype, device):
                raise Fail(
                    ACLNN_ERR_INNER_TILING_ERROR,
                    f"{name}: changed since phase 1: expected shape {fmt_shape(shape)} {dtype_name(dtype)} on "
                    f"{device}, got {fmt_shape(now[0])} {dtype_name(now[1])} on {now[2]}",
                )
        results = self.call()
        results = results if isinstance(results, (tuple, list)) else (results,)
        for out, res in zip(self.outs.values(), results):
            if out is None:
                continue
            n = res.shape[0] if res.dim() else 1
            if res.dim() and n < out.shape[0]:
                out[:n].copy_(res)
                out[n:].zero_()
            else:
                out.copy_(res)


def _byte_span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage, first byte, past the last byte)`` of the elements of a non-empty tensor."""
    size = t.element_size()
    first = t.storage_offset() * size
    last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * size
    return t.untyped_storage().data_ptr(), first, last + size


class AclOpExecutor:
    """What phase 1 hands back: the validated call, run once by phase 2. Opaque to callers."""

    __slots__ = ("_api", "_plan", "_used")

    def __init__(self, api: str, plan: Plan):
        self._api = api
        self._plan = plan
        self._used = False

    def __repr__(self) -> str:
        state = "used" if self._used else "ready"
        return f"<AclOpExecutor {self._api} workspace={self._plan.workspace_size} {state}>"


def phase1(api: str):
    """Decorate ``plan(<CANN inputs, attributes, outs>) -> Plan`` into ``aclnn<api>GetWorkspaceSize``, which
    returns ``(status, workspace_size, executor)`` and never raises."""

    def wrap(plan: Callable[..., Plan]):
        @functools.wraps(plan)
        def get_workspace_size(*args, **kwargs):
            _tls.msg = None
            try:
                p = plan(*args, **kwargs)
            except Fail as f:
                return _record(api, f.status, f.msg), 0, None
            except Exception as exc:  # never raise to the caller
                return _record(api, ACLNN_ERR_INNER_TILING_ERROR, f"unexpected {type(exc).__name__}: {exc}"), 0, None
            return ACLNN_SUCCESS, int(p.workspace_size), AclOpExecutor(api, p)

        return get_workspace_size

    return wrap


def phase2(api: str, op: str):
    """``aclnn<api>(workspace, workspaceSize, executor, stream) -> status``: runs the executor of phase 1 of
    ``api`` (the Python op ``op``) into its out tensors."""

    def run(workspace, workspaceSize, executor, stream):  # noqa: N803 (CANN's names)
        return _phase2(api, workspace, workspaceSize, executor, stream)

    run.__name__ = run.__qualname__ = api
    run.__doc__ = (f"Phase 2 of ``{op}``: computes into the out tensors given to {api}GetWorkspaceSize. "
                   "Returns a status.")
    return run


def _workspace_error(workspace, workspace_size, need: int, device, phase1_name: str) -> tuple[int, str] | None:
    if isinstance(workspace_size, bool) or not isinstance(workspace_size, int) or workspace_size < 0:
        return ACLNN_ERR_PARAM_INVALID, f"workspaceSize: expected an int >= 0, got {workspace_size!r}"
    if workspace_size < need:
        return (ACLNN_ERR_PARAM_INVALID,
                f"workspaceSize: expected >= {need} bytes (as returned by {phase1_name}), got {workspace_size}")
    if workspace is None:
        if need > 0:
            return ACLNN_ERR_PARAM_NULLPTR, f"workspace: is None but {need} bytes are needed"
        return None
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
        got = dtype_name(workspace.dtype) + " tensor" if isinstance(workspace, torch.Tensor) else type(workspace).__name__
        return ACLNN_ERR_PARAM_INVALID, f"workspace: expected None or a uint8 tensor, got {got}"
    if workspace.numel() < max(need, workspace_size):
        return (ACLNN_ERR_PARAM_INVALID,
                f"workspace: expected at least {max(need, workspace_size)} bytes, got a tensor of {workspace.numel()}")
    if need > 0 and workspace.device != device:
        return ACLNN_ERR_PARAM_INVALID, f"workspace: expected a tensor on {device}, got one on {workspace.device}"
    return None


def _phase2(api: str, workspace, workspace_size, executor, stream) -> int:
    _tls.msg = None
    phase1_name = api + "GetWorkspaceSize"
    if executor is None:
        return _record(api, ACLNN_ERR_PARAM_NULLPTR, "executor: is None (nullptr)")
    if not isinstance(executor, AclOpExecutor):
        return _record(api, ACLNN_ERR_PARAM_INVALID,
                       f"executor: expected the AclOpExecutor returned by {phase1_name}, got {type(executor).__name__}")
    if executor._api != api:
        return _record(api, ACLNN_ERR_PARAM_INVALID,
                       f"executor: was created by {executor._api}GetWorkspaceSize, not by {phase1_name}")
    if executor._used:
        return _record(api, ACLNN_ERR_PARAM_INVALID,
                       f"executor: has already run; an executor runs once, call {phase1_name} again")
    plan = executor._plan
    bad = _workspace_error(workspace, workspace_size, plan.workspace_size, plan.device, phase1_name)
    if bad is not None:
        return _record(api, *bad)
    if stream is not None and not (torch.cuda.is_available() and isinstance(stream, torch.cuda.Stream)):
        return _record(api, ACLNN_ERR_PARAM_INVALID,
                       f"stream: expected None or a torch.cuda.Stream, got {type(stream).__name__}")
    executor._used = True
    try:
        with torch.no_grad():
            if stream is not None:
                with torch.cuda.stream(stream):
                    plan.run()
            else:
                plan.run()
    except Fail as f:
        return _record(api, f.status, f.msg)
    except (ValueError, TypeError, NotImplementedError) as exc:
        # phase 1 ran every check, so this is not expected; the op raises before anything is written
        return _record(api, *python_error(exc, plan.names))
    except Exception as exc:
        return _record(api, ACLNN_ERR_RUNTIME_ERROR, f"{type(exc).__name__}: {exc}")
    return ACLNN_SUCCESS


# Context options


def aclrtCtxSetSysParamOpt(opt, value) -> int:  # noqa: N802
    """``aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1 | 0)``: NSA-grad determinism on/off, the same switch
    as :func:`sparseops.set_deterministic`. Returns ``ACL_SUCCESS`` (0), or ``ACL_ERROR_INVALID_PARAM``
    for another option or a value other than 0/1."""
    _tls.msg = None
    if isinstance(opt, bool) or opt != ACL_OPT_DETERMINISTIC:
        _tls.msg = f"aclrtCtxSetSysParamOpt: opt: only ACL_OPT_DETERMINISTIC ({ACL_OPT_DETERMINISTIC}) is supported, got {opt!r}"
        return ACL_ERROR_INVALID_PARAM
    if isinstance(value, bool) or value not in (0, 1):
        _tls.msg = f"aclrtCtxSetSysParamOpt: value: expected 0 or 1, got {value!r}"
        return ACL_ERROR_INVALID_PARAM
    _config.set_deterministic(bool(value))
    return ACL_SUCCESS


def aclrtCtxGetSysParamOpt(opt) -> tuple[int, int]:  # noqa: N802
    """``(status, value)`` of a switch set by :func:`aclrtCtxSetSysParamOpt`."""
    _tls.msg = None  # a success clears the last failure's text, as every call of this module does
    if isinstance(opt, bool) or opt != ACL_OPT_DETERMINISTIC:
        _tls.msg = f"aclrtCtxGetSysParamOpt: opt: only ACL_OPT_DETERMINISTIC ({ACL_OPT_DETERMINISTIC}) is supported, got {opt!r}"
        return ACL_ERROR_INVALID_PARAM, 0
    return ACL_SUCCESS, int(_config.is_deterministic())
