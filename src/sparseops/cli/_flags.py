"""Flag checks the subcommands share, made before any work: a seed torch accepts, an output folder or file that
can be written; and the results file written whole or not at all. ``check_*`` exit (``SystemExit``: status 2,
one line naming the command and the flag); ``sparseops train``, whose ranks decide who reports, takes the
``*_problem`` answers (cli/_group.py)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

#: the seeds every generator the commands seed accepts, with room for the offsets added to them
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 2**32


def seed_problem(seed: int) -> str | None:
    """What is wrong with ``--seed``, or None."""
    if not SEED_MIN <= seed <= SEED_MAX:
        return f"--seed: expected an int in [{SEED_MIN}, {SEED_MAX}], got {seed}"
    return None


#: what torchrun gives each worker (``env://``: the process group reads the last two)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's environment, None without ``WORLD_SIZE`` (one process).

    Raises:
        ValueError: ``WORLD_SIZE`` set but the rest missing or not integers in range (a stray variable, not
            torchrun): naming the variables, before the process group's own traceback.
    """
    if "WORLD_SIZE" not in os.environ:
        return None
    missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    try:
        rank, world, local = (int(os.environ.get(k, "0")) for k in TORCHRUN_ENV[:3])
    except ValueError:
        rank = world = -1
    if missing or not 0 <= rank < world:
        got = ", ".join(f"{k}={os.environ[k]!r}" for k in TORCHRUN_ENV if k in os.environ)
        missing_text = f" (missing: {', '.join(missing)})" if missing else ""
        raise ValueError(f"expected torchrun's environment ({', '.join(TORCHRUN_ENV)}; 0 <= RANK < WORLD_SIZE) when "
                         f"WORLD_SIZE is set, got {got}{missing_text}: launch with torchrun, or unset WORLD_SIZE to run "
                         "in one process")
    return rank, world, local


def adamw_problem(lr: float, weight_decay: float, dtype_max: float, beta1: float = 0.9) -> str | None:
    """What is wrong with ``--lr`` / ``--weight-decay`` for parameters whose largest value is ``dtype_max``, or
    None: AdamW converts its first step's size ``lr / (1 - beta1)`` and ``lr * weight_decay`` to the parameters'
    dtype, and one beyond its range fails inside ``optimizer.step`` after the process group exists."""
    if lr / (1 - beta1) > dtype_max:
        return (f"--lr: expected at most {dtype_max * (1 - beta1):.4g} (AdamW's first step size, lr / (1 - {beta1}), "
                f"in the range of --dtype), got {lr}")
    if lr * weight_decay > dtype_max:
        return (f"--weight-decay: expected --lr * --weight-decay at most {dtype_max:.4g} (in the range of --dtype), "
                f"got {lr} * {weight_decay} = {lr * weight_decay:.4g}")
    return None


def memory_bytes(cuda_device: int | None = None) -> int | None:
    """The memory a rank allocates its model in: the machine's physical memory, or the CUDA device's (None:
    unknown)."""
    try:
        if cuda_device is not None:
            import torch

            return int(torch.cuda.get_device_properties(cuda_device).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AssertionError):
        return None


def out_dir_problem(flag: str, folder: str | os.PathLike) -> str | None:
    """What keeps ``folder`` from being written or created (its nearest existing ancestor is a file, or not
    writable), or None. Creates nothing (a run that fails another check leaves no folder behind)."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = "is a file" if not probe.is_dir() else None if os.access(probe, os.W_OK | os.X_OK) else "is not writable"
    if why is None:
        return None
    return f"{flag}: expected a directory that can be written, got {os.fspath(folder)!r} ({os.fspath(probe)!r} {why})"


def out_file_problem(flag: str, path: str | os.PathLike, replace: bool = False) -> str | None:
    """What keeps ``path`` from being written as a file (a directory, or a folder :func:`out_dir_problem` refuses;
    with ``replace``, which writes a file beside it and renames it over, an existing device or pipe), or None."""
    path = Path(path)
    if path.is_dir():
        return f"{flag}: expected a file path, got {os.fspath(path)!r}, a directory"
    if replace and path.exists() and not path.is_file():
        return f"{flag}: expected a regular file path, got {os.fspath(path)!r}, which exists and is not a regular file"
    return out_dir_problem(flag, path.parent)


def outputs_problem(folder: str | os.PathLike | None, file: str | os.PathLike | None, folder_flag: str,
                    file_flag: str) -> str | None:
    """Create the output ``folder`` and ``file``'s folder (either None: none) and write a probe file in each, so
    that a target that cannot be written fails now, before any work, not at the first checkpoint or the end of a
    run; what went wrong, or None. Nothing is created when :func:`out_dir_problem` or :func:`out_file_problem`
    refuses either (the checks come first)."""
    targets, problems = [], []
    if folder is not None:
        targets.append((folder_flag, Path(folder)))
        problems.append(out_dir_problem(folder_flag, folder))
    if file is not None:
        targets.append((file_flag, Path(file).parent))
        problems.append(out_file_problem(file_flag, file, replace=True))
    problem = next(filter(None, problems), None)
    if problem is not None:
        return problem
    for flag, where in targets:  # and by writing there (a check of the mode bits says yes to root)
        try:
            where.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".sparseops-write-check-", dir=where)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return (f"{flag}: expected a directory that can be written, got {os.fspath(where)!r} "
                    f"({exc.strerror or exc})")
    return None


def _exit(prog: str, problem: str | None) -> None:
    if problem is not None:
        raise SystemExit(f"{prog}: {problem}")


def check_seed(prog: str, seed: int) -> None:
    _exit(prog, seed_problem(seed))


def check_out_dir(prog: str, flag: str, folder: str | os.PathLike) -> None:
    _exit(prog, out_dir_problem(flag, folder))


def check_out_file(prog: str, flag: str, path: str | os.PathLike) -> None:
    _exit(prog, out_file_problem(flag, path))


def restart_store_warning() -> str | None:
    """Rank 0's warning when torchrun may restart the workers (``--max-restarts`` > 0) with its rendezvous store
    shared with them (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default): the store outlives an attempt, and a
    restarted group's gloo set-up can read the previous attempt's addresses and fail (pytorch/pytorch#135712);
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt its own store (docs/training.md, "Faults")."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("sparseops train: warning: torchrun --max-restarts with its rendezvous store shared with the workers "
            "(TORCHELASTIC_USE_AGENT_STORE=True): a restarted group can read the previous attempt's addresses and fail "
            "to connect (pytorch/pytorch#135712); launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")


def write_json(path: Path, record: dict) -> str | None:
    """Write ``record`` to ``path`` whole or not at all (a file beside it, then renamed); what failed, or None."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return f"could not write {os.fspath(path)!r} ({exc.strerror or exc}); the run's results are lost"
    return None
