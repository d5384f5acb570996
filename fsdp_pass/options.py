"""The ``options`` dict of ``torch.compile(model, backend="vescale", options={...})``, validated."""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, NamedTuple, NoReturn

import torch

__all__ = ["Fp8Options", "Options", "QuantizedReduce", "check_cudagraphs_off", "check_mp_dtype", "inductor_settings",
           "mp_policy_casts", "mp_policy_dtypes", "refuse_cudagraphs"]


def _switch_or_mapping(value: Any, parsed: type, refusal: str) -> Any:
    """An option that is off (None, False), on with defaults (True), already ``parsed``, or a dict of
    settings: None, the parsed value, or the dict (``{}`` for True); anything else raises ``refusal``."""
    if value is None or value is False:
        return None
    if isinstance(value, parsed):
        return value
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(refusal)
    return value


@dataclass(frozen=True)
class Fp8Options:
    """``options["fp8_all_gather"]``, validated ([Note: FP8 all-gather] in buckets/gather.py).

    Attributes:
        tile: tiles are ``tile × tile`` elements with one float32 scale each (default 128).
        include: fnmatch patterns of parameter names gathered in FP8 besides the default ones
            (2-D / stacked 3-D weights of repeated units such as ``layers.3``).
        exclude: fnmatch patterns of parameter names kept in ``param_dtype``.
    """

    tile: int = 128
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: Any, argument: str = "options['fp8_all_gather']") -> "Fp8Options | None":
        """``value`` checked; ``argument`` names it in messages (the backend option, or fully_shard's keyword)."""
        value = _switch_or_mapping(value, cls, f"{argument} is {value!r}; use True or a dict with keys 'tile', "
                                              f"'include', 'exclude'")
        if not isinstance(value, Mapping):
            return value
        unknown = sorted(set(value) - {"tile", "include", "exclude"})
        if unknown:
            raise ValueError(f"unknown {argument} key(s) {unknown}; use 'tile', 'include', 'exclude'")
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(
                f"{argument} needs torch.float8_e4m3fn, which this torch build ({torch.__version__}) "
                f"lacks; upgrade torch (2.1 or later) or drop the option"
            )
        tile = value.get("tile", 128)
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"{argument}['tile'] must be a positive integer (e.g. 128), got {tile!r}")
        patterns = {}
        for key in ("include", "exclude"):
            given = value.get(key, ())
            given = (given,) if isinstance(given, str) else tuple(given)
            if not all(isinstance(g, str) for g in given):
                raise ValueError(f"{argument}['{key}'] must be fnmatch patterns (strings), got {given!r}")
            patterns[key] = given
        return cls(tile, patterns["include"], patterns["exclude"])


class QuantizedReduce(NamedTuple):
    """``options["quantized_reduce"]``, validated ([Note: block-quantized gradient reduction] in
    buckets/quantized_reduce.py); a constant of the rewritten graph's ``gather_bucket`` calls."""

    block: int = 128  # elements per quantization block (one float32 scale each), inside one rank's part
    stochastic: bool = False  # stochastic rounding instead of round to nearest

    @classmethod
    def parse(cls, value: Any) -> "QuantizedReduce | None":
        where = "options['quantized_reduce']"
        value = _switch_or_mapping(value, cls, f"{where} is {value!r}; use True or a dict with keys 'bits' (8), "
                                              f"'block' (elements per scale, e.g. 128) and 'rounding' ('nearest' or "
                                              f"'stochastic')")
        if not isinstance(value, Mapping):
            return value
        unknown = sorted(set(value) - {"bits", "block", "rounding"})
        if unknown:
            raise ValueError(f"unknown {where} key(s) {unknown}; use 'bits', 'block', 'rounding'")
        if value.get("bits", 8) != 8:
            raise ValueError(f"{where}['bits'] is {value['bits']!r}; only 8 (int8 codes) is implemented: use 8")
        block = value.get("block", 128)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"{where}['block'] must be a positive number of elements per scale (e.g. 128), got {block!r}")
        rounding = value.get("rounding", "nearest")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"{where}['rounding'] is {rounding!r}; use 'nearest' or 'stochastic'")
        return cls(block, rounding == "stochastic")


def check_reshard_after_forward(value: Any, argument: str) -> None:
    """Raise unless ``value`` is True, False or a group size (an int > 1; whether it divides the shard dim
    is checked when the mesh is known: ``fsdp_pass.buckets.mesh.check_reshard_group_size``)."""
    if not isinstance(value, bool) and not (isinstance(value, int) and value > 1):
        raise ValueError(f"{argument} is {value!r}; use True (reshard over all ranks), False (keep parameters "
                         f"gathered) or a group size k > 1 that divides the shard dim, e.g. 8 for the GPUs of a node")


def check_divide_factor(factor: Any, where: str) -> float:
    """``factor`` as a float, or raise unless it is a positive finite number."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{where} must be a positive number (1.0: sum, the data-parallel degree: mean), got {factor!r}")
    return float(factor)


def mp_policy_dtypes(mp_policy: Any) -> tuple[Any, Any]:
    """``(param_dtype, reduce_dtype)`` of an ``mp_policy``: a mapping with those keys, or an object with those
    attributes (``torch.distributed.fsdp.MixedPrecisionPolicy``); None where not set. Each still needs
    :func:`check_mp_dtype`."""
    if mp_policy is None:
        return None, None
    if isinstance(mp_policy, Mapping):
        extra = set(mp_policy) - {"param_dtype", "reduce_dtype"}
        if extra:
            raise ValueError(f"unknown mp_policy key(s) {sorted(extra)}; use param_dtype and reduce_dtype")
        return mp_policy.get("param_dtype"), mp_policy.get("reduce_dtype")
    return getattr(mp_policy, "param_dtype", None), getattr(mp_policy, "reduce_dtype", None)


def mp_policy_casts(mp_policy: Any) -> tuple[Any, bool]:
    """``(output_dtype, cast_forward_inputs)`` of an ``mp_policy``: a ``MixedPrecisionPolicy``'s fields (FSDP2's
    defaults, None and True, for a mapping or None)."""
    if mp_policy is None or isinstance(mp_policy, Mapping):
        return None, True
    return getattr(mp_policy, "output_dtype", None), bool(getattr(mp_policy, "cast_forward_inputs", True))


def check_mp_dtype(dtype: Any, name: str) -> None:
    """Raise unless ``dtype`` (mp_policy's ``name``) is None or a floating torch.dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"mp_policy {name} must be a floating torch.dtype, got {dtype!r}")


@dataclass(frozen=True)
class Options:
    """Every option the backend accepts (all optional).

    Attributes:
        mesh: a 1-D DeviceMesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP); default: all ranks.
            With tensor- or expert-parallel DTensor parameters: the whole named mesh, e.g.
            ``("dp", "tp")``, whose TP/EP dims the parameters' meshes are sliced from.
        shard_dim: which dim of a 2-D mesh shards (default: the last); on a named mesh a dim name or a
            tuple of names (data-parallel dims: the batch is split over them; list an expert-parallel
            dim here too, experts are then sharded over the other ones).
        replicate_dim: the HSDP dim of a named mesh (default: none; on a 2-D mesh without TP/EP
            parameters, the dim that is not ``shard_dim``).
        compiler: ``"inductor"`` (default) or ``"aot_eager"`` (debugging) after the passes.
        compile_blocks_once: blocks of a graph that are the same computation (``layers.0`` …
            ``layers.n-1``) become calls of one subgraph that AOTAutograd and Inductor compile once, so
            compile time does not grow with depth (default True; False compiles the graph flat; see
            [Note: repeated blocks compiled once] in compile/passes/outline.py).
        shared_compile_cache: the ranks share one compile cache folder (``TORCHINDUCTOR_CACHE_DIR``,
            node-local or on a shared file system): rank 0 compiles each graph first, the others then
            load AOTAutograd's and Inductor's output from it, as does a later launch (default False; see
            [Note: ranks compile a graph once between them] in compile/shared_cache.py).
        reshard_after_forward: free gathered parameters after forward and gather again in backward
            (default True, ZeRO-3 memory; or what ``fully_shard`` set); False keeps them (less
            communication, more memory); an int k (FSDP2's meaning: the ranks of a node) keeps 1/k of
            each bucket per rank and gathers backward's parameters within groups of k consecutive ranks
            of the shard dim ([Note: reshard within a node after forward] in
            compile/passes/reshard_within_groups.py).
        reshard_last_bucket: with ``reshard_after_forward``, also free the last bucket a graph
            gathers (default False: a graph that gathers several buckets keeps its last one for
            backward, which needs it first; see [Note: the last bucket stays gathered into backward]).
        overlap_last_reduce: leave the reduce-scatter of the bucket a graph gathers first (backward's
            last) in flight after backward, and wait for it where its gradient is first read, so the
            optimizer step overlaps it (default False; see [Note: the last reduce-scatter overlaps the
            optimizer step] in step/deferred_reduce.py). Graphs of one bucket keep their reduce-scatter.
        prefetch_next_step: issue the all-gathers a graph starts with (its first ``prefetch`` + 1
            buckets) when the optimizer step ends, so they overlap what runs until the next forward;
            that forward takes them unless a rank's shard changed since (default False; see [Note: the
            next step's first gather starts at the optimizer step] in step/prefetch.py).
        step_reduced_first: while the last reduce-scatter is in flight (``overlap_last_reduce``), an
            optimizer's ``step()`` runs over the parameters whose gradients are reduced first, then over
            the rest, through torch's optimizer step hooks (default False; see [Note: the reduced
            gradients are stepped first] in step/reduced_first.py). Only for optimizers whose update of
            a parameter reads nothing of the others (torch's and fsdp_pass's all qualify).
        mp_policy: mixed precision, ``{"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}``
            or a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
        bucket_size: most elements in one communication bucket (default: no limit; each module unit,
            such as ``layers.3``, is a bucket, merged with its neighbours up to ``min_bucket_bytes``).
        min_bucket_bytes: neighbouring units are grouped until a bucket holds at least this many bytes
            (default: a latency x bandwidth cost model, 1.3 MB on CPU/gloo, 1.5 MB on GPUs; 0: never merge).
        block_sizes: ``{fnmatch pattern on parameter names: rows}`` (or ``{"elements": n}``): blocks
            that no rank boundary may cut.
        align_bytes: tensor starts and shard sizes are multiples of this many bytes (default 16).
        prefetch: issue each all_gather this many buckets ahead of its use (default 1; 0 turns the
            overlap scheduling off; on CPU, one collective in flight at a time: [Note: one
            collective in flight on gloo] in compile/passes/schedule.py).
        max_inflight_bytes: most bytes of gathered buckets in flight at once when prefetching
            (default: no bound).
        fp8_all_gather: ``True`` or ``{"tile": 128, "include": [...], "exclude": [...]}`` (fnmatch
            patterns on parameter names): gather the 2-D / stacked 3-D weights of repeated units as
            FP8 codes + one scale per tile (see [Note: FP8 all-gather] in buckets/gather.py and
            docs/fp8.md). Held as an :class:`Fp8Options` (None: off).
        quantized_reduce: ``True`` or ``{"bits": 8, "block": 128, "rounding": "nearest"}``: every bucket's
            gradient reduce-scatter moves int8 codes and one float32 scale per ``block`` elements (blocks
            never cut by a rank boundary) instead of ``reduce_dtype`` values, as one all-to-all ([Note:
            block-quantized gradient reduction] in buckets/quantized_reduce.py). Lossy: measured as error
            and convergence in docs/benchmarks.md. Held as a :class:`QuantizedReduce` (None: off).
        two_level_collectives: when the launcher reports that a bucket's ranks span nodes, gather and
            reduce in two levels, across the nodes then within ([Note: collectives in two levels across
            nodes] in buckets/node_collectives.py; default True); False: one step over the shard group.
        gradient_divide_factor: divide the gradients summed over the data-parallel ranks by this
            (default: the data-parallel degree, a mean; 1.0: the sum), as
            :func:`fsdp_pass.set_gradient_divide_factor`.
        mode: torch.compile's ``mode`` (``"default"``, ``"max-autotune-no-cudagraphs"``, ...), with Inductor's
            meaning: the Inductor settings torch's own table gives it (``torch._inductor.list_mode_options``).
            An option because ``torch.compile`` refuses ``mode=`` together with ``options=``; alone it
            comes as ``torch.compile``'s ``mode=``. Modes that turn on CUDA graphs are refused
            ([Note: no CUDA graphs around the collectives]).
        inductor: Inductor config settings for the graphs this backend compiles (``{"epilogue_fusion":
            False}``): the mode's settings, then every key of ``options`` that is an Inductor config key
            (``torch._inductor.list_options()``) rather than an fsdp_pass option.
    """

    mesh: Any = None
    shard_dim: int | str | tuple[str, ...] | None = None
    replicate_dim: int | str | None = None
    compiler: str = "inductor"
    compile_blocks_once: bool = True
    shared_compile_cache: bool = False
    reshard_after_forward: bool | int = True
    reshard_last_bucket: bool = False
    overlap_last_reduce: bool = False
    prefetch_next_step: bool = False
    step_reduced_first: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    bucket_size: int | None = None
    min_bucket_bytes: int | None = None
    block_sizes: Mapping[str, Any] = field(default_factory=dict)
    align_bytes: int = 16
    prefetch: int = 1
    max_inflight_bytes: int | None = None
    fp8_all_gather: "Fp8Options | None" = None
    two_level_collectives: bool = True
    gradient_divide_factor: float | None = None
    quantized_reduce: QuantizedReduce | None = None
    mode: str | None = None
    inductor: Mapping[str, Any] = field(default_factory=dict)  # Inductor config key → value, passed to compile_fx

    _NAMES = ("mesh", "shard_dim", "replicate_dim", "compiler", "compile_blocks_once", "shared_compile_cache", "reshard_after_forward", "reshard_last_bucket",
              "overlap_last_reduce", "prefetch_next_step", "step_reduced_first", "mp_policy", "bucket_size",
              "min_bucket_bytes", "block_sizes", "align_bytes", "prefetch", "max_inflight_bytes", "fp8_all_gather",
              "two_level_collectives", "gradient_divide_factor", "quantized_reduce", "mode")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None, mode: str | None = None) -> "Options":
        """``options`` validated; ``mode`` is ``torch.compile``'s (which never comes with ``options``)."""
        options = dict(options or {})
        inductor = {key: options.pop(key) for key in list(options) if key not in cls._NAMES}
        if mode is not None:
            options["mode"] = mode
        options["inductor"] = inductor_settings(options.get("mode"), inductor)
        policy = options.pop("mp_policy", None)
        if mp_policy_casts(policy)[0] is not None:
            raise ValueError("options['mp_policy'] has an output_dtype, which a compile option cannot apply (the "
                             "compiled graph is the module's inside, not its call); give the policy to "
                             "fsdp_pass.fully_shard(module, mp_policy=...), which casts the module's outputs")
        options["param_dtype"], options["reduce_dtype"] = mp_policy_dtypes(policy)
        options["fp8_all_gather"] = Fp8Options.parse(options.get("fp8_all_gather"))
        options["quantized_reduce"] = QuantizedReduce.parse(options.get("quantized_reduce"))
        made = cls(**options)
        if made.compiler not in ("inductor", "aot_eager"):
            raise ValueError(f"options['compiler'] is {made.compiler!r}; use 'inductor' or 'aot_eager'")
        if made.inductor and made.compiler != "inductor":
            raise ValueError(f"Inductor settings {sorted(made.inductor)} (from mode={made.mode!r} or Inductor keys in "
                             f"options) have no effect with options['compiler']={made.compiler!r}; drop them or "
                             f"compile with 'inductor'")
        for name in ("param_dtype", "reduce_dtype"):
            check_mp_dtype(getattr(made, name), name)
        check_reshard_after_forward(made.reshard_after_forward, "options['reshard_after_forward']")
        if made.prefetch < 0:
            raise ValueError(f"options['prefetch'] must be >= 0 buckets, got {made.prefetch}")
        if made.gradient_divide_factor is not None:
            check_divide_factor(made.gradient_divide_factor, "options['gradient_divide_factor']")
        if made.bucket_size is not None and made.bucket_size < 1:
            raise ValueError(f"options['bucket_size'] must be a positive element count, got {made.bucket_size}")
        return made

    def describe(self) -> dict[str, Any]:
        """Every field and its value (``explain()`` prints them; the shared compile cache digests them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# [Note: no CUDA graphs around the collectives]
# Inductor's CUDA graphs ("reduce-overhead", "max-autotune", triton.cudagraphs) would capture fsdp_pass's
# graphs with their collectives inside: torch 2.13 tags no functional collective ``cudagraph_unsafe``
# and lists none in ``torch._inductor.utils.FORBIDDEN_CUDAGRAPH_OPS``, so
# ``get_first_incompatible_cudagraph_node`` lets them through. A replay re-launches the captured
# kernels without running Python: the ``fsdp_pass::take_gathered`` op's hand-over (a gather the
# optimizer step issued, buckets/gather.py), a reduce-scatter left in flight for the optimizer step
# (step/deferred_reduce.py), and the per-call choice between a graph's variants (compile/backend.py)
# would all be frozen at the capture. So whatever turns CUDA graphs on is refused, with the same message:
# ``mode=`` or ``triton.cudagraphs`` in ``options`` when the options are read (``inductor_settings``), and,
# when a graph is about to go to Inductor (``check_cudagraphs_off``), Inductor's live config
# (``torch._inductor.config.triton.cudagraphs`` set by the user, inside a ``config.patch``, or from
# ``TORCHINDUCTOR_CUDAGRAPHS=1``, which torch reads into that config when it imports it) and Dynamo's
# ``torch._dynamo.override_cudagraphs(fwd=True)`` annotation of the graph. The fix named is the same mode
# less its CUDA graphs; every other Inductor setting passes through.
_CUDAGRAPHS = "triton.cudagraphs"
_CUDAGRAPHS_ENV = "TORCHINDUCTOR_CUDAGRAPHS"


def inductor_settings(mode: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor config patches for ``mode`` (torch's own table) updated with ``settings`` (Inductor config keys,
    ``-`` read as ``_`` as torch.compile reads them), each key and value checked as torch.compile checks them."""
    from torch._inductor import config, list_mode_options

    modes = list_mode_options()
    if mode is not None and mode not in modes:
        raise ValueError(f"mode {mode!r} is not a torch.compile mode; use one of {sorted(modes)}")
    known = config.get_config_copy()
    patches = dict(modes[mode]) if mode is not None else {}
    for key, value in settings.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in known:
            raise ValueError(_unknown_key_message(key, known))
        expected = config.get_type(name)
        if getattr(expected, "__origin__", None) is None and isinstance(expected, type) and not isinstance(value, expected):
            raise ValueError(f"Inductor option {key!r} takes a {type(known[name]).__name__}, got {value!r}")
        patches[name] = value
    if patches.get(_CUDAGRAPHS):
        refuse_cudagraphs(f"options[{_CUDAGRAPHS!r}]" if settings.get(_CUDAGRAPHS) else f"mode={mode!r}")
    return patches


def refuse_cudagraphs(source: str) -> NoReturn:
    """Raise the refusal of Inductor's CUDA graphs turned on by ``source`` ([Note: no CUDA graphs around the
    collectives]); every door to them gets this one message."""
    raise ValueError(
        f"{source} turns on Inductor's CUDA graphs, which fsdp_pass does not support: they would capture the "
        f"all-gathers and reduce-scatters, and a replay skips the Python side of fsdp_pass's collectives "
        f"(prefetched and in-flight buckets); use mode='max-autotune-no-cudagraphs' (max-autotune without CUDA "
        f"graphs) or the default mode, and leave triton.cudagraphs off"
    )


def check_cudagraphs_off(opts: "Options", graph_meta: Mapping[str, Any]) -> None:
    """Refuse a compile for which Inductor would turn CUDA graphs on, read as Inductor reads it when it is
    handed the graph: Dynamo's ``override_cudagraphs`` annotation of the graph (``graph_meta``, the graph
    module's ``meta``) first, then ``opts.inductor`` (the ``config_patches`` the backend gives Inductor), then
    Inductor's config as it is now (a global setting, a ``config.patch`` around the call, or
    ``TORCHINDUCTOR_CUDAGRAPHS=1``, read into the config at its import). Nothing to check with aot_eager."""
    if opts.compiler != "inductor":
        return
    from torch._inductor import config

    annotated = getattr(graph_meta.get("cudagraph_annotation"), "fwd", None)  # torch._dynamo.override_cudagraphs
    if annotated is not None:
        if annotated:
            refuse_cudagraphs("torch._dynamo.override_cudagraphs(fwd=True) around the compiled code")
        return
    if opts.inductor.get(_CUDAGRAPHS, config.triton.cudagraphs):
        if _CUDAGRAPHS in opts.inductor:  # refused when the options were read; kept for an Options built by hand
            refuse_cudagraphs(f"options[{_CUDAGRAPHS!r}]")
        from_env = os.environ.get(_CUDAGRAPHS_ENV) == "1"
        refuse_cudagraphs(f"torch._inductor.config.{_CUDAGRAPHS} = True"
                          + (f" ({_CUDAGRAPHS_ENV}=1 in the environment, which sets it when torch imports the config, "
                             f"or a setting of the config)" if from_env else " (set in the config or by a config.patch)"))


def _unknown_key_message(key: Any, inductor_keys: Mapping[str, Any]) -> str:
    """The refusal of a key that is neither an fsdp_pass option nor an Inductor config key, naming the closest of both."""
    text = str(key)
    ours = difflib.get_close_matches(text, Options._NAMES, n=3)
    theirs = difflib.get_close_matches(text.replace("-", "_"), list(inductor_keys), n=3)
    return (f"unknown fsdp_pass option(s) [{key!r}]; valid options are {sorted(Options._NAMES)}, and Inductor config "
            f"keys (torch._inductor.list_options()); closest fsdp_pass options: {ours or 'none'}, closest Inductor "
            f"keys: {theirs or 'none'}")
