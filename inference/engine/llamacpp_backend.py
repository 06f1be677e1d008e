"""The engine's target on llama.cpp's CPU kernels: our trees, proposers, verifier and sampling; llama.cpp's forward and
KV cache (through `specheads.llamacpp.tree_target`, libllama built from the pinned release).

How a tree becomes one llama.cpp batch: llama.cpp masks a token's attention to the cache cells that carry the
token's first sequence id at positions up to its own. So every input that must see a set of inputs of its own (a
tree node: its ancestors; an extra row: the rows it `sees`) gets a sequence id as its query, and every input carries
the query ids of all inputs that see it; an input whose view is the front of another's (a node on a path to a leaf)
shares that one's id, so a tree uses one id per leaf. Each row owns a block of ids; its committed prefix is held by
its first (its main sequence), and is added to the other ids a step uses before the batch runs (llama.cpp's
`seq_cp` on one unified cache: no data moves). Positions are the prefix length plus depth.

Committing a path keeps the id whose view holds the accepted path, trims it to the path's length, relabels it as
the row's main sequence and drops every other id of the step: the rejected nodes' cells are freed, nothing is
copied, nothing re-run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.inference.engine.target_backend import TargetHidden, TargetOutput
from specheads.inference.engine.tree import DraftTree
from specheads.llamacpp import tree_target

KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml_type of each KV cache type (ggml.h)
# The architectures whose llama.cpp graph keeps a layer's input for llama_get_embeddings_layer_inp (the model files of
# src/models/ that set t_layer_inp, in the pinned release; tests check the list against its source). Asking another
# for a layer's input would stop llama.cpp with an assertion, so it is refused first.
LAYER_INPUT_ARCHITECTURES = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "hunyuan-vl", "lfm2", "llama", "mimo2", "minimax-01", "minimax-m2",
    "muse-glimmer", "nanbeige", "nemotron-h", "openai-moe", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next",
    "qwen4exp"})
# The KV cache in the weights' precision, as our PyTorch forward keeps it (F32 and BF16 files); quantized weights keep
# llama.cpp's default, f16. The bench's llama.cpp rows use the same.
CACHE_TYPES = {"f32": "f32", "bf16": "bf16"}


@dataclass(frozen=True)
class _Step:
    """What one row's inputs of the last forward left in the cache, for its commit."""

    ids: tuple[int, ...]  # the sequence ids the step used; ids[0] is the row's main sequence
    query: list[int]  # [N] the query id of each of the row's tree nodes


class LlamaCppBackend:
    """The target as a GGUF file run by llama.cpp: rows are blocks of `ids_per_row` sequence ids in one unified cache
    of `context` cells (default 4096 a row: every row's committed tokens plus the step's inputs).

    `kv_cache`: the KV cache's type (f32 by default; llama.cpp's own default, f16, rounds every step's keys and
    values). `flash_attention`: llama.cpp's flash-attention kernel; by default off with an f32 cache and llama.cpp's
    own choice (on, on a CPU) otherwise, as the bench runs `llama-server`: on the CPU it rounds K and V through f16,
    and a tree's batch and a one-token step about 100 times further apart than the plain kernels do (1e-3 against
    1e-5 on a tiny F32 target's logits). A batch and a one-token step still sum their matrix products in another
    order, so in F32 speculative greedy output equals llama.cpp's plain greedy output except where the target's two
    best logits tie within that rounding. `threads`: llama.cpp's threads (default: one per core, as `llama-server`
    runs). `batch`: the most inputs one llama.cpp graph runs (longer prompts run in chunks; a step's trees must
    fit)."""

    name = "llamacpp"
    device = torch.device("cpu")

    def __init__(self, gguf: str | Path, *, max_rows: int = 1, context: int | None = None, kv_cache: str = "f32",
                 flash_attention: bool | None = None, threads: int | None = None, batch: int = 512,
                 library: Path | None = None) -> None:
        self.lib = tree_target.load(library)
        self.library = library
        self.max_rows = max_rows
        max_seq = self.lib.tt_max_seq()
        if max_rows > max_seq // 2:
            raise ValueError(f"llama.cpp holds at most {max_seq} sequence ids, so at most {max_seq // 2} rows of "
                             f"trees; got max_rows={max_rows}")
        self.ids_per_row = max_seq // max_rows
        self.max_leaves = self.ids_per_row  # a leaf's path takes a sequence id (extra rows may take more)
        self.gguf = Path(gguf)
        if kv_cache not in KV_TYPES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_TYPES)}, got {kv_cache!r}")
        if not self.gguf.is_file():
            raise ValueError(f"no GGUF file at {self.gguf}; convert the target first (specheads export --to gguf, or "
                             "specheads.llamacpp.target_gguf)")
        err = ctypes.create_string_buffer(1024)
        self.batch = batch
        threads = threads or os.cpu_count() or 1
        if flash_attention is None:  # as the bench runs llama-server: off with an f32 cache, llama.cpp's choice else
            flash_attention = False if kv_cache == "f32" else None
        self.threads, self.flash_attention = threads, flash_attention
        # llama.cpp cuts its batch to the context, and reserves an output for every sequence id in each batch
        context = max(context or 4096 * max_rows, batch, max_seq)
        self._t = self.lib.tt_open(str(self.gguf).encode(), context, batch,
                                   max_rows * self.ids_per_row, threads, KV_TYPES[kv_cache],
                                   -1 if flash_attention is None else int(flash_attention), err, len(err))
        if not self._t:
            raise RuntimeError(f"{err.value.decode()}: {tree_target.last_log(self.lib)}")
        self.context = self.lib.tt_n_ctx(self._t)
        self.vocab_size = self.lib.tt_n_vocab(self._t)
        self.hidden_size = self.lib.tt_n_embd(self._t)
        self.num_layers = self.lib.tt_n_layer(self._t)
        self.max_context = min(self.context // max_rows, self.lib.tt_n_ctx_train(self._t))
        self.kv_cache = kv_cache
        self.architecture = gguf_architecture(self.gguf)
        self.lengths: list[int] = []  # committed entries of each occupied row
        self._steps: list[_Step | None] = []  # per row: what its last forward left to commit
        self._layers: tuple[int, ...] = ()  # HF hidden_states indices read (`read_layers`)

    def cost_key(self) -> str:
        """What a step's time depends on besides the machine's CPU: the file, the cache type, the kernels and threads,
        and the library (named by llama.cpp's version, the CPU's flags and its own source)."""
        stat = self.gguf.stat()
        library = self.library or tree_target.tree_target_library()
        text = "\n".join(map(str, [self.gguf.resolve(), stat.st_size, stat.st_mtime_ns, self.kv_cache,
                                    self.flash_attention, self.threads, self.batch, library]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """The forward in words, for people (a calibration's machine)."""
        from specheads.machine import hardware_name

        return (f"llama.cpp on {self.gguf.name} ({self.architecture}, KV cache {self.kv_cache}, flash attention "
                f"{'auto' if self.flash_attention is None else 'on' if self.flash_attention else 'off'}) on "
                f"{hardware_name(self.device)} ({self.threads} threads)")

    def measurement_copy(self, rows: int, capacity: int) -> LlamaCppBackend:
        """A backend like this one with `rows` rows of `capacity` tokens, for timing its forwards."""
        return LlamaCppBackend(self.gguf, max_rows=rows, context=rows * capacity, kv_cache=self.kv_cache,
                               flash_attention=self.flash_attention, threads=self.threads, batch=self.batch,
                               library=self.library)

    def __del__(self) -> None:
        t, self._t = getattr(self, "_t", None), None
        if t:
            self.lib.tt_close(t)

    # -- hidden states ----------------------------------------------------------------------------------------------

    def read_layers(self, layers: tuple[int, ...] | None) -> None:
        """Keep these HF hidden_states indices (0: the embeddings; k < L: layer k's input; L or -1: the final norm's
        output) from every forward that asks for hidden states."""
        if layers is None:
            raise ValueError("the proposer reads the target's hidden states without naming their layers (its "
                             "target_layers), and llama.cpp keeps only the layers named before a forward; give the "
                             "proposer a target_layers tuple, or run it on the torch backend")
        wanted = sorted({self.num_layers if i == -1 else i for i in layers})
        if any(not 0 <= i <= self.num_layers for i in wanted):
            raise ValueError(f"hidden_states indices must be in [0, {self.num_layers}] or -1 for this "
                             f"{self.num_layers}-layer target, got {list(layers)}")
        if wanted[:1] != [self.num_layers] and wanted and self.architecture not in LAYER_INPUT_ARCHITECTURES:
            raise ValueError(f"llama.cpp's {self.architecture} graph keeps no layer inputs, which these heads read "
                             f"(hidden_states {list(layers)}); run them on the torch backend, or use a drafter that "
                             "reads none (ngram, suffix, lookahead, a draft model)")
        for i in range(self.num_layers):
            self.lib.tt_keep_layer_input(self._t, i, int(i in wanted))
        self.lib.tt_keep_final_hidden(self._t, int(self.num_layers in wanted))
        self._layers = tuple(wanted)

    # -- rows -------------------------------------------------------------------------------------------------------

    def _main(self, row: int) -> int:
        return row * self.ids_per_row

    def add_row(self, capacity: int) -> int:
        if len(self.lengths) == self.max_rows:
            raise ValueError(f"all {self.max_rows} rows are occupied")
        if capacity > self.max_context:
            raise ValueError(f"a sequence of up to {capacity} tokens does not fit the {self.max_context} cells a row "
                             f"has in llama.cpp's cache of {self.context}; raise the backend's context")
        self.lengths.append(0)
        self._steps.append(None)
        return len(self.lengths) - 1

    def remove_row(self, row: int) -> int | None:
        self.lib.tt_seq_rm(self._t, self._main(row), -1, -1)
        last = len(self.lengths) - 1
        self.lengths[row], self._steps[row] = self.lengths[last], self._steps[last]
        self.lengths.pop()
        self._steps.pop()
        if row == last:
            return None
        # relabel: the last row's cells gain this row's main id and lose their own (no data moves)
        self.lib.tt_seq_cp(self._t, self._main(last), self._main(row), -1, -1)
        self.lib.tt_seq_rm(self._t, self._main(last), -1, -1)
        return last

    def committed_tokens(self) -> int:
        return sum(self.lengths)

    def reset(self) -> None:
        self.lib.tt_clear(self._t)
        self.lengths.clear()
        self._steps.clear()

    # -- forwards ---------------------------------------------------------------------------------------------------

    def prefill(self, row: int, prompt: torch.Tensor, *, hidden: bool) -> TargetOutput:
        main, n = self._main(row), prompt.shape[0]
        tokens = prompt.to(torch.int32).contiguous()
        positions = torch.arange(n, dtype=torch.int32)
        # the final norm's output exists only where logits do, so reading it takes logits at every position
        every = hidden and self.num_layers in self._layers
        parts: list[list[torch.Tensor]] = [[] for _ in self._layers]
        logits = torch.empty(0)
        for start in range(0, n, self.batch):
            end = min(start + self.batch, n)
            outputs = torch.full((end - start,), int(every), dtype=torch.int8)
            outputs[-1] = int(every or end == n)  # else only the prompt's last position gives logits
            self._decode(tokens[start:end], positions[start:end], [[main]] * (end - start), outputs)
            if hidden:
                for part, layer in zip(parts, self._layers):
                    part.append(self._hidden(layer, end - start, outputs))
            if end == n:
                logits = self._logits([end - start - 1])
        self.lengths[row] = n - 1  # the prompt's last token is the first step's root, committed with its path
        self._steps[row] = _Step(ids=(main,), query=[main])
        return TargetOutput(logits[None], self._expand([torch.cat(p)[None] for p in parts]) if hidden else None)

    def verify(self, first_row: int, trees: list[DraftTree], *, hidden: bool) -> TargetOutput:
        width = max(t.input_size for t in trees)
        tokens, positions, seqs, offsets = [], [], [], []
        for b, tree in enumerate(trees):
            row = first_row + b
            ids, query, carried = self._encode(row, tree)
            for seq in ids[1:]:  # every id but the main one reads the row's committed prefix too
                self.lib.tt_seq_cp(self._t, ids[0], seq, -1, -1)
            self._steps[row] = _Step(ids=ids, query=query[: tree.size])
            offsets.append(len(tokens))
            tokens += tree.input_tokens.tolist()
            positions += (tree.input_depths.cpu() + self.lengths[row]).tolist()
            seqs += carried
        n = len(tokens)
        self._decode(torch.tensor(tokens, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32), seqs,
                     torch.ones(n, dtype=torch.int8))
        flat = self._logits(list(range(n)))  # [n, V]
        logits = flat.new_zeros(len(trees), width, self.vocab_size)
        for b, (tree, start) in enumerate(zip(trees, offsets)):
            logits[b, : tree.input_size] = flat[start : start + tree.input_size]
        states = None
        if hidden:
            every = torch.ones(n, dtype=torch.int8)
            rows = []
            for layer in self._layers:
                flat_h = self._hidden(layer, n, every)
                h = flat_h.new_zeros(len(trees), width, self.hidden_size)
                for b, (tree, start) in enumerate(zip(trees, offsets)):
                    h[b, : tree.input_size] = flat_h[start : start + tree.input_size]
                rows.append(h)
            states = self._expand(rows)
        return TargetOutput(logits, states)

    def commit(self, row: int, path: torch.Tensor) -> None:
        step = self._steps[row]
        assert step is not None, "commit follows a forward over the row"
        keep = step.query[int(path[-1])]  # its view holds the whole accepted path
        main, length = step.ids[0], self.lengths[row]
        for seq in step.ids:
            if seq != keep:
                self.lib.tt_seq_rm(self._t, seq, length if seq == main else -1, -1)
        self.lib.tt_seq_rm(self._t, keep, length + path.numel(), -1)  # the path's deeper nodes and any extra rows
        if keep != main:
            self.lib.tt_seq_cp(self._t, keep, main, -1, -1)
            self.lib.tt_seq_rm(self._t, keep, -1, -1)
        self.lengths[row] = length + path.numel()
        self._steps[row] = None

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _encode(self, row: int, tree: DraftTree) -> tuple[tuple[int, ...], list[int], list[list[int]]]:
        """The sequence ids of `row`'s step over `tree`: the ids it uses (the main one first), each input's query id,
        and the ids each input carries (its query first, as llama.cpp reads a token's first id as its own)."""
        main = self._main(row)
        n = tree.input_size
        if tree.is_plain_chain:  # plain steps and chains: the main sequence alone, as plain decoding runs
            return (main,), [main] * n, [[main]] * n
        visible = tree.input_visible  # [n, n] bool: visible[i, j]: input i sees input j
        if tree.extra is None:  # a tree: each leaf (seen by itself alone) owns an id; a node asks as a leaf below it
            leaves = (visible.sum(0) == 1).nonzero().squeeze(1)
            owners = leaves.tolist()
            query = visible[leaves].T.int().argmax(1).tolist()  # the first leaf at or below each node
        else:
            owners, query = _owners(visible, tree.input_depths.cpu())
        if len(owners) > self.ids_per_row:
            raise ValueError(f"a tree of {len(owners)} leaves needs as many llama.cpp sequence ids, and a row has "
                             f"{self.ids_per_row} (of {self.lib.tt_max_seq()}, shared by {self.max_rows} rows); draft "
                             "smaller trees (a lower node budget) or fewer rows")
        ids = tuple(main + k for k in range(len(owners)))
        seen_by = visible[torch.tensor(owners)].T.tolist()  # [n][owners]: which owners see each input
        carried = [[ids[query[j]]] + [ids[k] for k, sees in enumerate(row) if sees and k != query[j]]
                   for j, row in enumerate(seen_by)]
        return ids, [ids[q] for q in query], carried

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, seqs: list[list[int]],
                outputs: torch.Tensor) -> None:
        n = tokens.shape[0]
        if n > self.batch:
            raise ValueError(f"a step of {n} inputs exceeds the llama.cpp backend's batch of {self.batch}; draft "
                             "smaller trees or fewer rows, or raise its batch")
        counts = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        ids = torch.tensor([x for s in seqs for x in s], dtype=torch.int32)
        tokens, positions, outputs = tokens.contiguous(), positions.contiguous(), outputs.contiguous()
        status = self.lib.tt_decode(self._t, n, tokens.data_ptr(), positions.data_ptr(), counts.data_ptr(),
                                    ids.data_ptr(), outputs.data_ptr())
        if status != 0:
            raise RuntimeError(f"llama.cpp's decode of {n} inputs failed (status {status}): "
                               f"{tree_target.last_log(self.lib) or 'it logged nothing'}")

    def _logits(self, index: list[int]) -> torch.Tensor:  # [len(index), V] float32
        out = torch.empty(len(index), self.vocab_size, dtype=torch.float32)
        idx = torch.tensor(index, dtype=torch.int32)
        if self.lib.tt_logits(self._t, len(index), idx.data_ptr(), out.data_ptr()) != 0:
            raise RuntimeError(f"llama.cpp gave no logits: {tree_target.last_log(self.lib)}")
        return out

    def _hidden(self, layer: int, n: int, outputs: torch.Tensor) -> torch.Tensor:  # [n, H] float32
        out = torch.empty(n, self.hidden_size, dtype=torch.float32)
        if layer == self.num_layers:
            idx = torch.arange(n, dtype=torch.int32)
            assert bool(outputs.all()), "the final hidden state exists where logits do"
            status = self.lib.tt_final_hidden(self._t, n, idx.data_ptr(), out.data_ptr())
        else:
            status = self.lib.tt_layer_input(self._t, layer, n, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"llama.cpp kept no hidden state of layer {layer}: {tree_target.last_log(self.lib)}")
        return out

    def _expand(self, parts: list[torch.Tensor]) -> TargetHidden:
        """HF's hidden_states order, the layers read filled in and the rest None."""
        full: list[torch.Tensor | None] = [None] * (self.num_layers + 1)
        for layer, part in zip(self._layers, parts):
            full[layer] = part
        return tuple(full)


def _owners(visible: torch.Tensor, depths: torch.Tensor) -> tuple[list[int], list[int]]:
    """For any inputs whose views are chains of ancestors (a tree's nodes and extra rows, `visible` [n, n] bool, their
    depths [n]): the inputs that own a sequence id, and each input's owner (by index into the first list). An input
    shares an owner whose view, cut at the input's depth, is the input's own view; else it owns one."""
    owners: list[int] = []
    query = [0] * visible.shape[0]
    for i in reversed(range(visible.shape[0])):  # deepest views first
        for k_index, k in enumerate(owners):
            if visible[k, i] and torch.equal(visible[i], visible[k] & (depths <= depths[i])):
                query[i] = k_index
                break
        else:
            query[i] = len(owners)
            owners.append(i)
    return owners, query


# general.file_type of a GGUF (llama.h's llama_ftype) -> the precision names used here
FILE_TYPES = {0: "f32", 1: "f16", 32: "bf16", 7: "q8_0", 3: "q4_1", 2: "q4_0"}


# GGUF's value types (gguf.h's gguf_type) -> struct formats of the fixed-size ones; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_header(path: Path, keys: tuple[str, ...]) -> dict[str, object]:
    """The values of `keys` among a GGUF file's metadata (scalars and strings), read from its header alone and stopping
    once all are found (the gguf package's reader maps every tensor first: seconds for a large file)."""
    import struct

    found: dict[str, object] = {}
    with open(path, "rb") as f:
        def read(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> str:
            return f.read(read("Q")).decode("utf-8", errors="replace")

        def value(kind: int):
            if kind in _GGUF_SCALARS:
                return read(_GGUF_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                item, count = read("I"), read("Q")
                for _ in range(count):
                    value(item)
                return None
            raise ValueError(f"{path} has a metadata value of unknown type {kind}; is it a GGUF file?")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        read("I")  # version
        read("Q")  # tensors
        for _ in range(read("Q")):
            key = string()
            found[key] = value(read("I"))
            if all(k in found for k in keys):
                break
    return {k: found.get(k) for k in keys}


def gguf_architecture(path: Path) -> str:
    """The GGUF's general.architecture (llama.cpp's name for its graph: "llama", "qwen3", ...)."""
    return str(gguf_header(path, ("general.architecture",))["general.architecture"] or "")


def gguf_precision(path: Path) -> str | None:
    """The precision a GGUF file states (its general.file_type), or None when it states none this knows."""
    file_type = gguf_header(path, ("general.file_type",))["general.file_type"]
    return None if file_type is None else FILE_TYPES.get(int(file_type))


def llamacpp_backend(target: str, gguf: str, *, max_rows: int = 1, **settings) -> LlamaCppBackend:
    """The llama.cpp backend for `target` (as `specheads.target` names it: `default`, a folder) on `gguf`: a
    precision (f32, bf16, q8_0: the target converted by llama.cpp's converter, cached; q4_1: the default target's
    shipped file) or a .gguf file of the same weights. The KV cache follows the weights (`CACHE_TYPES`) unless
    `settings` name one."""
    from specheads.llamacpp.target_gguf import PRECISIONS, target_gguf

    if gguf in PRECISIONS:
        path, precision = target_gguf(target, gguf), gguf
    elif gguf.endswith(".gguf") and Path(gguf).is_file():
        path = Path(gguf)
        precision = gguf_precision(path)
    else:
        raise ValueError(f"--gguf {gguf!r} is neither a precision ({', '.join(PRECISIONS)}) nor a .gguf file; give "
                         "one of the precisions (the target converted once and cached) or the path of the target's "
                         "GGUF")
    settings.setdefault("kv_cache", CACHE_TYPES.get(precision or "", "f16"))
    return LlamaCppBackend(path, max_rows=max_rows, **settings)

