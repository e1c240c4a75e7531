"""Preflight: the checks of a config against this machine, before any worker starts.

The launch environment (``NNODES``, ``NGPU``, ``NODE_RANK``, ``MASTER_ADDR``: the layout's
processes, this node's place, a private rendezvous address), the data (every part the run reads
opens and holds text), the tokenizer (present, fits ``model.vocab_size``, names an EOS token), a
writable dump folder, a wandb API key when wandb logs online, the C compiler and Python headers
flex attention compiles with, a GPU whose shared memory fits the flex kernel Inductor would build
and, when the run would resume, a checkpoint of this model's shapes. Each failure is one
``ConfigError`` line.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

from protocol_models.model.subspace import read_basis
from protocol_models.tools.errors import ConfigError, require
from protocol_models.training.trainer import ProtocolTrainer


def validate_environment(config: ProtocolTrainer.Config, *, worker: bool = False) -> None:
    """Checks against the file system: the basis file, data, tokenizer, dump folder, checkpoint
    to resume; outside a ``worker`` (the launcher's check) first the launch environment
    (``check_launch_environment``). The bundled Shakespeare data, when read and not yet
    prepared, is left to ``scripts/train.sh`` (which prepares it after its check, before the
    workers start); in a ``worker`` nothing prepares it any more, so there it is one line naming
    the prepare command (not TorchTitan's traceback about the missing tokenizer)."""
    from protocol_models.data import corpus
    from protocol_models.data import loader as data
    from protocol_models.tools import cpu_shim

    if not worker:  # first: later checks read NNODES and NODE_RANK
        check_launch_environment(config)
    cpu_shim.check_device(config.hardware.device, cpu_shim.launch_device())
    if config.protocol.basis_file:
        read_basis(config.protocol.basis_file, config.model.dim, config.protocol.k)
    pending = data.bundled_data_pending(config)
    if pending and worker:
        raise ConfigError(unprepared_bundled_data(config))
    parts = {}
    for side in ["train", "validation"] if config.validator.enable else ["train"]:
        if not (pending and data.is_bundled(config.dataloader, side)):
            parts[side] = corpus.part_of(config.dataloader, side)
            corpus.check_readable(parts[side])
    if len(parts) == 2:
        corpus.check_disjoint(parts["train"], parts["validation"])
    if not (pending and data.is_bundled_path(config.hf_assets_path)):
        _check_tokenizer(config)
    _check_writable(config.dump_folder)
    if config.model.attention == "flex":
        check_flex_toolchain()
        check_flex_shared_memory(config)
    if config.metrics.enable_wandb and holds_metrics_rank(config):
        check_wandb_key()
    _check_checkpoint_store(config)
    _check_resumable(config)
    if config.dataloader.hf_dataset and "LOCAL_RANK" not in os.environ:
        corpus.check_hub_dataset(config.dataloader.hf_dataset)


def check_launch_environment(
    config: ProtocolTrainer.Config, env: Mapping[str, str] = os.environ
) -> None:
    """The values ``scripts/train.sh`` launches with, against the config's layout: ``NNODES``
    and the processes per node (``_check_processes``), ``NODE_RANK`` (``_check_node_rank``) and,
    on a job of several nodes, ``MASTER_ADDR`` (``_check_master_addr``), which must not be
    public (``public_address_problem``). ``REGION`` may be anything or unset (then a node's
    region is its host name). Each failure is one ``ConfigError`` line ``KEY=value: ...``."""
    from protocol_models.tools.interfaces import public_address_problem

    nodes = _whole_number("NNODES", env.get("NNODES") or "1", 1, "the number of nodes")
    _check_processes(config, env, nodes)
    _check_node_rank(env, nodes)
    if nodes > 1:
        _check_master_addr(env, nodes)
    problem = public_address_problem(env)
    require(problem is None, problem or "")


def _whole_number(key: str, value: str, minimum: int, what: str) -> int:
    """``value`` of ``key`` as a number: digits only and no leading zero, as the bash arithmetic
    and comparisons of ``scripts/train.sh`` need it."""
    require(
        re.fullmatch(r"0|[1-9][0-9]*", value) and int(value) >= minimum,
        f"{key}={value}: must be a whole number >= {minimum} ({what})",
    )
    return int(value)


def _check_processes(config: ProtocolTrainer.Config, env: Mapping[str, str], nodes: int) -> None:
    """``nodes`` x the processes per node (``NGPU``, else ``NPROC_PER_NODE``, else
    ``scripts/train.sh``'s default: ``config.world_size`` / ``NNODES``) must be the layout's
    ``config.world_size`` -- or a multiple of it with ``data_parallel_shard_degree = -1``, which
    TorchTitan sets to the ranks left over. Otherwise TorchTitan refuses the mesh in every
    worker."""
    par, needed = config.parallelism, config.world_size
    spare = par.data_parallel_shard_degree == -1
    layout = (
        f"the config's layout needs {needed} processes (pipeline_parallel_degree "
        f"{par.pipeline_parallel_degree} x data-parallel {config.replicas} x "
        f"tensor_parallel_degree {par.tensor_parallel_degree})"
        + (" or a multiple (data_parallel_shard_degree = -1 shards over the rest)" if spare else "")
    )
    key = next((k for k in ("NGPU", "NPROC_PER_NODE") if env.get(k)), None)
    if key is None:
        require(
            needed % nodes == 0,
            f"NNODES={nodes}: {layout}, which {nodes} nodes cannot share equally (the default "
            f"NGPU is {needed} / NNODES); use an NNODES that divides {needed}"
            + (", or set NGPU" if spare else ""),
        )
        return
    per_node = _whole_number(key, env[key], 1, "processes per node")
    world = nodes * per_node
    fix = (
        f"set {key}={needed // nodes}"
        if needed % nodes == 0
        else f"use an NNODES that divides {needed}"
    )
    require(
        world == needed or (spare and world % needed == 0),
        f"{key}={per_node}: NNODES={nodes} x {key}={per_node} = {world} processes, but {layout}; "
        f"{fix}",
    )


def _check_node_rank(env: Mapping[str, str], nodes: int) -> None:
    """``NODE_RANK``, this node's place (its global ranks and so its pipeline stages), is one of
    ``0 … NNODES − 1``; it must be given when there are several nodes (one node: default 0)."""
    value = env.get("NODE_RANK") or ("0" if nodes == 1 else "(unset)")
    require(
        value in {str(n) for n in range(nodes)},
        f"NODE_RANK={value}: must be one of 0..{nodes - 1} (NNODES={nodes}): this node's place "
        "in the job, a different one on each node",
    )


def _check_master_addr(env: Mapping[str, str], nodes: int) -> None:
    """A job of several nodes meets at ``MASTER_ADDR`` (node 0, which hosts the rendezvous
    store): it must be given, and resolve on this node."""
    value = env.get("MASTER_ADDR")
    where = (
        f"with NNODES={nodes} every node needs node 0's address (the rendezvous), the same on "
        "each: its private or overlay address (docs/multinode.md)"
    )
    require(value, f"MASTER_ADDR=(unset): {where}")
    try:
        socket.getaddrinfo(value, None)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"MASTER_ADDR={value}: does not resolve on this node; {where}") from None


def unprepared_bundled_data(config: ProtocolTrainer.Config) -> str:
    """The one line for a worker reading the bundled data before it was prepared: the first key
    that reads it, the missing tokenizer file and the command that makes both."""
    from protocol_models.data import corpus, shakespeare
    from protocol_models.data import loader as data

    loader = config.dataloader
    readers = [("hf_assets_path", config.hf_assets_path), ("dataloader.files", loader.files),
               ("dataloader.validation_files", loader.validation_files)]  # fmt: skip
    key, value = next(
        (k, v) for k, v in readers if any(data.is_bundled_path(p) for p in corpus.as_list(v))
    )
    missing = (shakespeare.DEFAULT_CACHE / "tokenizer" / "tokenizer.json").resolve()
    return (
        f"{key} = {value!r}: the bundled Shakespeare data is not prepared ({missing} is "
        f"missing); run `python -m protocol_models.prepare` in {Path.cwd()} first "
        "(scripts/train.sh does it before it starts the workers)"
    )


def _check_tokenizer(config: ProtocolTrainer.Config) -> None:
    """``hf_assets_path`` holds a ``tokenizer.json`` whose vocabulary fits ``model.vocab_size``;
    when it is missing, the error names the command that fetches it."""
    path = config.hf_assets_path
    tokenizer_json = Path(path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        repo = config.hf_assets_repo or "REPO_ID"
        fetch = f"python -m protocol_models.assets {repo} --dest {path}"
        raise ConfigError(
            f"hf_assets_path = {path!r}: no tokenizer.json there; fetch it with: {fetch}"
            + ("" if config.hf_assets_repo else " (REPO_ID: the tokenizer's Hub repository)")
        )
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the tokenizers library's own words
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"hf_assets_path = {path!r}: {tokenizer_json} does not load: {reason}"
        ) from None
    require(
        size <= config.model.vocab_size,
        f"model.vocab_size = {config.model.vocab_size}: smaller than the tokenizer's {size} "
        f"tokens ({tokenizer_json}); use model.vocab_size >= {size}",
    )
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    logging.disable(logging.WARNING)  # e.g. "no tokenizer_config.json": the check below says it
    try:
        eos = HuggingFaceTokenizer(tokenizer_path=path).eos_id
    finally:
        logging.disable(logging.NOTSET)
    require(
        eos is not None,
        f"hf_assets_path = {path!r}: the tokenizer names no EOS token, so documents would run "
        f"together; name one as eos_token (and bos_token) in {Path(path, 'tokenizer_config.json')}",
    )


WANDB_KEYLESS_MODES = ("offline", "disabled", "dryrun")
"""``WANDB_MODE`` values that need no API key."""


def holds_metrics_rank(config: ProtocolTrainer.Config, env=os.environ) -> bool:
    """Whether this process (a worker: ``RANK``) or this node (the launcher's check: ``NODE_RANK``
    of ``NNODES``, ranks numbered node by node) holds the rank that logs: the first rank of the
    last pipeline stage, as TorchTitan chooses it. Only there does wandb run."""
    pp = config.parallelism.pipeline_parallel_degree
    world = config.world_size
    logging_rank = (world // pp) * (pp - 1)
    if "RANK" in env and "LOCAL_RANK" in env:
        return int(env["RANK"]) == logging_rank
    per_node = world // max(int(env.get("NNODES", "1")), 1)
    node = int(env.get("NODE_RANK", "0"))
    return node * per_node <= logging_rank < (node + 1) * per_node


def check_wandb_key(env=os.environ) -> None:
    """wandb logging online needs an API key on this node: ``WANDB_API_KEY``, an identity token
    file (``WANDB_IDENTITY_TOKEN_FILE``) or a ``wandb login`` entry in the netrc file (``NETRC``,
    else ``~/.netrc``) for ``WANDB_BASE_URL``'s host (default ``api.wandb.ai``). Without one,
    ``wandb.init`` raises in the metrics rank after the GPUs were allocated."""
    import netrc
    from urllib.parse import urlsplit

    mode = (env.get("WANDB_MODE") or "online").lower()
    if mode in WANDB_KEYLESS_MODES or env.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError(
        f"metrics.enable_wandb = true and WANDB_MODE = {mode!r}, but this node has no wandb API "
        f"key (no WANDB_API_KEY, no {host} entry in {path}): set WANDB_API_KEY (or run `wandb "
        "login`), set WANDB_MODE=offline to sync later with `wandb sync`, or metrics.enable_wandb "
        "= false"
    )


def check_flex_toolchain(env=os.environ, include: str | None = None) -> None:
    """Flex attention is compiled (TorchTitan: ``torch.compile`` at max-autotune, the block-mask
    builder too), and Triton builds each kernel's launcher as a C extension: it needs a C
    compiler (``$CC``, else ``gcc`` or ``clang`` on ``PATH``, as Triton looks) and Python's
    headers (``Python.h`` in ``include``, default: this interpreter's). Without them the first
    forward fails in every worker after the GPUs were allocated."""
    import shutil
    import sysconfig

    path = env.get("PATH")
    if env.get("CC"):
        found, missing = shutil.which(env["CC"], path=path), f"CC = {env['CC']!r} is not a program"
    else:
        found = shutil.which("gcc", path=path) or shutil.which("clang", path=path)
        missing = "no CC, no gcc or clang on PATH"
    require(
        found,
        'model.attention = "flex" is compiled, and Triton builds its kernels\' launchers with a '
        f"C compiler: {missing}; install gcc (e.g. apt install build-essential) or set CC",
    )
    include = include or sysconfig.get_paths()["include"]
    require(
        os.path.isfile(os.path.join(include, "Python.h")),
        'model.attention = "flex" is compiled, and Triton builds its kernels\' launchers '
        f"against Python's headers: no Python.h in {include}; install them (e.g. apt install "
        f"python{sysconfig.get_python_version()}-dev)",
    )


SMALL_SHARED_MEMORY = 101376
"""Opt-in shared memory per block, in bytes, of the sm_86/sm_89/sm_120 cards (L4, A10, A40,
RTX 3090/4090/5090): 99 KB. Inductor's default flex forward kernel for sm_8x at bf16 and
head_dim 128 (``BLOCK_M`` 128, ``BLOCK_N`` 64, ``num_stages`` 3, 8 warps) needs ~128 KB: the Q
tile, 128 x 128 x 2 bytes, plus 3 stages of a K and a V tile, 3 x 2 x 64 x 128 x 2 bytes, the
131074 bytes of pytorch/pytorch#133254 on a 4090. At 2 stages it needs 96 KB and fits, which is
Inductor's own default for sm_120 (also 99 KB); at max-autotune Inductor benchmarks several tile
configs and skips those that do not fit."""

FLEX_TILE_OPTIONS = ("BLOCK_M", "BLOCK_N", "num_stages")
"""``kernel_options`` keys (bare, or ``fwd_``-prefixed) that pin the flex forward kernel's tiles
(``torch/_inductor/kernel/flex/flex_attention.py``), replacing Inductor's default ones."""


def flex_max_autotune(config: ProtocolTrainer.Config, env=os.environ) -> tuple[bool, str]:
    """Whether Inductor builds this run's flex kernels at max-autotune, and the settings that
    decide it, as a clause for a message. ``[compile]`` on the model at backend ``inductor``
    compiles each block whole: flex is then lowered inside the block with the block's Inductor
    settings, at max-autotune only with ``TORCHINDUCTOR_MAX_AUTOTUNE=1`` (the nested
    ``torch.compile`` of TorchTitan's ``FlexAttention`` and its options do not apply). Otherwise
    (no model compile, or ``aot_eager``, whose flex region TorchTitan hands to Inductor) flex
    compiles with TorchTitan's ``FlexAttention.inductor_configs``: max-autotune in 0.3.0."""
    from torchtitan.models.common.attention import FlexAttention

    if _blocks_compiled_by_inductor(config):
        value = env.get("TORCHINDUCTOR_MAX_AUTOTUNE")
        shown = "unset" if value is None else f"= {value!r}"
        return value == "1", (
            'compile.enable = true (backend "inductor") compiles each block whole, flex inside '
            f"it without max-autotune (TORCHINDUCTOR_MAX_AUTOTUNE {shown})"
        )
    return bool(FlexAttention.inductor_configs.get("max_autotune")), (
        "TorchTitan's FlexAttention.inductor_configs has max_autotune off"
    )


def _blocks_compiled_by_inductor(config: ProtocolTrainer.Config) -> bool:
    compile_ = config.compile
    return compile_.enable and "model" in compile_.components and compile_.backend == "inductor"


def flex_kernel_options(config: ProtocolTrainer.Config) -> list[dict]:
    """The ``kernel_options`` of each block's flex attention, as the run builds the model."""
    from protocol_models.model.model import build_model_config

    model = build_model_config(config.model, config.protocol, config.layout_stages)
    return [dict(block.attention.inner_attention.kernel_options) for block in model.layers]


def visible_gpus() -> list:
    """``torch.cuda.get_device_properties`` of each GPU this process sees (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]


def check_flex_shared_memory(config: ProtocolTrainer.Config, env=os.environ, gpus=None) -> None:
    """Flex attention on a GPU with at most 99 KB of shared memory per block
    (``SMALL_SHARED_MEMORY``: the L4) needs Inductor at max-autotune (``flex_max_autotune``) or
    the forward kernel's tiles pinned in every block's ``kernel_options`` (any of
    ``FLEX_TILE_OPTIONS``: the user's choice is trusted): Inductor's default forward kernel does
    not fit, and the first forward of every worker would fail with "out of resource: shared
    memory" after the GPUs were allocated. ``gpus``: the probe (default ``visible_gpus``), a
    function returning each visible GPU's properties (``name``, ``shared_memory_per_block_optin``),
    called only when the settings alone do not rule the failure out."""
    if config.model.attention != "flex" or config.hardware.device != "cuda":
        return
    autotune, settings = flex_max_autotune(config, env)
    if autotune:
        return
    tiles = set(FLEX_TILE_OPTIONS)
    options = flex_kernel_options(config)
    if options and all(tiles & {key.removeprefix("fwd_") for key in o} for o in options):
        return
    for index, gpu in enumerate((gpus or visible_gpus)()):
        limit = gpu.shared_memory_per_block_optin
        if limit > SMALL_SHARED_MEMORY:
            continue
        if _blocks_compiled_by_inductor(config):
            fix = (
                "set TORCHINDUCTOR_MAX_AUTOTUNE=1 on every node (a longer first compile), "
                'compile.backend = "aot_eager" (flex keeps max-autotune) or compile.enable = false'
            )
        else:
            fix = (
                "turn it back on, or pin kernel_options that fit: BLOCK_M = 128, BLOCK_N = 64, "
                "num_stages = 2, num_warps = 8 (Inductor's default on 99 KB sm_120 cards)"
            )
        raise ConfigError(
            f'model.attention = "flex": {settings} and no kernel_options pin its tiles, and '
            "Inductor's default flex kernel (~128 KB of shared memory per block at bf16, "
            f"head_dim 128) does not fit GPU {index} ({gpu.name}: {limit} bytes); {fix}"
        )


def _check_writable(dump_folder: str) -> None:
    """The nearest existing ancestor of ``dump_folder`` must be a directory we can write in
    (probed with a temporary file that is removed at once; nothing is left behind)."""
    import tempfile

    path = Path(dump_folder).absolute()
    ancestor = next(p for p in [path, *path.parents] if p.exists())
    try:
        require(ancestor.is_dir(), f"dump_folder = {dump_folder!r}: {ancestor} is not a directory")
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        raise ConfigError(
            f"dump_folder = {dump_folder!r}: not writable ({e.strerror}: {ancestor})"
        ) from None


def _check_checkpoint_store(config: ProtocolTrainer.Config) -> None:
    """A checkpoint folder in an object store must be one this node can write
    (``checkpoint_store.store_problem``)."""
    if not config.checkpoint.enable:
        return
    from protocol_models.training.checkpoint_store import checkpoint_folder, store_problem

    folder = checkpoint_folder(config)
    problem = store_problem(folder)
    require(problem is None, f"checkpoint.folder = {folder!r}: {problem}; an object store needs "
            "its fsspec backend (s3://: pip install 'protocol-models[s3]') and, for an "
            "S3-compatible service, AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY on every node")  # fmt: skip


def _check_resumable(config: ProtocolTrainer.Config) -> None:
    """A checkpoint the run would load must hold this config's parameter shapes (with
    ``per_node``, those of the parameters this node's checkpoint holds)."""
    checkpoint = _checkpoint_to_load(config)
    if checkpoint is None:
        return
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torchtitan.tools import filesystem

    from protocol_models.model.model import build_model_config

    with torch.device("meta"):
        model = build_model_config(config.model, config.protocol, config.layout_stages).build()
    reader = FsspecReader if filesystem.is_remote(checkpoint) else FileSystemReader
    saved = reader(checkpoint).read_metadata().state_dict_metadata
    for name, tensor in model.state_dict().items():
        if config.checkpoint.per_node and name not in saved:
            continue  # a node's checkpoint holds the stages on this node only
        require(
            name in saved,
            f"checkpoint {checkpoint} does not hold parameter {name} of this model "
            "([model] or [protocol] differ from the run that wrote it)",
        )
        saved_shape = tuple(getattr(saved[name], "size", ()))
        require(
            saved_shape == tuple(tensor.shape),
            f"checkpoint {checkpoint} was written by a different model: {name} is "
            f"{list(saved_shape)} there but {list(tensor.shape)} with this config "
            f"(protocol.k = {config.protocol.k}, model.dim = {config.model.dim}); "
            "resume with the settings that wrote it or use another dump_folder",
        )


def _checkpoint_to_load(config: ProtocolTrainer.Config) -> str | None:
    """What TorchTitan's checkpointer would load at start: the newest complete ``step-N`` in
    the run's checkpoint folder (with ``per_node``, this node's), else
    ``checkpoint.initial_load_path``."""
    ckpt = config.checkpoint
    if not ckpt.enable or ckpt.create_seed_checkpoint:
        return None
    from torchtitan.tools import filesystem

    from protocol_models.training.checkpoint_store import checkpoint_folder
    from protocol_models.training.checkpointing import complete_step_numbers, node_folder_name

    folder = checkpoint_folder(config)
    if ckpt.per_node:  # this node's own folder (scripts/train.sh: NODE_RANK of NNODES)
        node = int(os.environ.get("NODE_RANK", "0"))
        nodes = int(os.environ.get("NNODES", "1"))
        folder = filesystem.join(folder, node_folder_name(node, nodes))
    steps = complete_step_numbers(folder)
    if steps:
        return filesystem.join(folder, f"step-{steps[-1]}")
    initial = ckpt.initial_load_path
    if initial and filesystem.isfile(filesystem.join(initial, ".metadata")):
        return initial
    return None
