// The target forward of specheads' engine on llama.cpp's kernels: a thin C ABI over libllama, compiled against the
// pinned release's own headers (so any change of a struct or signature there is a compile error, never a crash) and
// linked with its static libraries into one shared library (`tree_target.py` builds and binds it).
//
// Everything crosses as plain integers, floats and pointers to caller-owned arrays: the engine builds each batch
// (one sequence id per root-to-leaf path of a row's tree; `pos` = prefix + depth) and keeps the cache's books
// (`llamacpp_backend.py`); this file only moves data in and out of llama.cpp.

#include "llama.h"
#include "llama-cparams.h"  // LLAMA_MAX_SEQ: the most sequence ids a context takes
#include "llama-ext.h"

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#define TT_API extern "C" __attribute__((visibility("default")))

// bumped with every change of a signature below; the binding refuses a library of another revision
static const int32_t TT_ABI = 1;

namespace {

std::mutex log_mutex;
std::string last_error;  // llama.cpp's last error or warning lines, quoted by the binding when a call fails

void on_log(ggml_log_level level, const char * text, void *) {
    if (level != GGML_LOG_LEVEL_ERROR && level != GGML_LOG_LEVEL_WARN && level != GGML_LOG_LEVEL_CONT) {
        return;  // llama.cpp's info and debug lines would flood the caller's terminal
    }
    std::lock_guard<std::mutex> lock(log_mutex);
    if (last_error.size() > 8192) {
        last_error.erase(0, last_error.size() - 4096);
    }
    last_error += text;
}

void set_error(char * err, int32_t err_size, const char * format, ...) {
    if (err == nullptr || err_size <= 0) {
        return;
    }
    va_list args;
    va_start(args, format);
    vsnprintf(err, (size_t) err_size, format, args);
    va_end(args);
}

}  // namespace

struct tt_target {
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    llama_memory_t mem = nullptr;
    llama_batch batch{};
    int32_t n_batch = 0;
    int32_t n_seq_max = 0;
    int32_t n_vocab = 0;
    int32_t n_embd = 0;
};

TT_API int32_t tt_abi(void) { return TT_ABI; }

TT_API int32_t tt_max_seq(void) { return LLAMA_MAX_SEQ; }

// Copies llama.cpp's logged errors and warnings since the last call into `out` (truncated to out_size), and clears
// them.
TT_API void tt_last_log(char * out, int32_t out_size) {
    std::lock_guard<std::mutex> lock(log_mutex);
    if (out != nullptr && out_size > 0) {
        snprintf(out, (size_t) out_size, "%s", last_error.c_str());
    }
    last_error.clear();
}

// Loads the GGUF at `path` on the CPU and makes a context of `n_ctx` cells shared by up to `n_seq_max` sequence ids
// (one unified cache, so a tree's paths share their prefix's cells), for batches of up to `n_batch` tokens.
// `kv_type`: the KV cache's ggml_type (-1: llama.cpp's default, F16). `flash_attn`: llama.h's llama_flash_attn_type
// (-1 auto, 0 off, 1 on); on the CPU its kernel rounds a batch and a one-token step further apart than the plain one
// does.
// Returns null with a message in `err` on failure.
TT_API tt_target * tt_open(const char * path, int32_t n_ctx, int32_t n_batch, int32_t n_seq_max, int32_t n_threads,
                           int32_t kv_type, int32_t flash_attn, char * err, int32_t err_size) {
    static std::once_flag backend_once;
    std::call_once(backend_once, [] {
        llama_log_set(on_log, nullptr);
        llama_backend_init();
    });
    if (n_seq_max < 1 || n_seq_max > LLAMA_MAX_SEQ) {
        set_error(err, err_size, "n_seq_max must be in [1, %d], got %d", LLAMA_MAX_SEQ, n_seq_max);
        return nullptr;
    }
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(path, mparams);
    if (model == nullptr) {
        set_error(err, err_size, "llama.cpp could not load %s", path);
        return nullptr;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) n_ctx;
    cparams.n_batch = (uint32_t) n_batch;
    cparams.n_ubatch = (uint32_t) n_batch;  // a tree or a prefill chunk is one graph, never split
    cparams.n_seq_max = (uint32_t) n_seq_max;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.kv_unified = true;  // sequence ids share cells: a prefix is held once for every path that reads it
    cparams.no_perf = true;
    cparams.flash_attn_type = (llama_flash_attn_type) flash_attn;
    if (kv_type >= 0) {
        cparams.type_k = (ggml_type) kv_type;
        cparams.type_v = (ggml_type) kv_type;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        llama_model_free(model);
        set_error(err, err_size, "llama.cpp could not make a context of %d cells for %s", n_ctx, path);
        return nullptr;
    }
    tt_target * t = new tt_target();
    t->model = model;
    t->ctx = ctx;
    t->mem = llama_get_memory(ctx);
    t->batch = llama_batch_init(n_batch, 0, n_seq_max);
    t->n_batch = n_batch;
    t->n_seq_max = n_seq_max;
    t->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    t->n_embd = llama_model_n_embd(model);
    return t;
}

TT_API void tt_close(tt_target * t) {
    if (t == nullptr) {
        return;
    }
    llama_batch_free(t->batch);
    llama_free(t->ctx);
    llama_model_free(t->model);
    delete t;
}

TT_API int32_t tt_n_vocab(const tt_target * t) { return t->n_vocab; }
TT_API int32_t tt_n_embd(const tt_target * t) { return t->n_embd; }
TT_API int32_t tt_n_layer(const tt_target * t) { return llama_model_n_layer(t->model); }
TT_API int32_t tt_n_ctx(const tt_target * t) { return (int32_t) llama_n_ctx(t->ctx); }
TT_API int32_t tt_n_ctx_train(const tt_target * t) { return llama_model_n_ctx_train(t->model); }

// Whether the next decodes keep the input of layer `layer` (HF's hidden_states[layer], for 0 <= layer < n_layer)
// and the final norm's output (`final`: HF's last hidden state) for every output token.
TT_API void tt_keep_layer_input(tt_target * t, int32_t layer, int32_t keep) {
    llama_set_embeddings_layer_inp(t->ctx, (uint32_t) layer, keep != 0);
}

TT_API void tt_keep_final_hidden(tt_target * t, int32_t keep) { llama_set_embeddings(t->ctx, keep != 0); }

// Decodes `n` tokens: token i at position pos[i] in the n_seq[i] sequences listed next in `seq_ids` (all tokens'
// lists one after another), with outputs (logits, final hidden state) where outputs[i] != 0. Returns llama_decode's
// status (0: done; nonzero: nothing of the batch was kept, except as llama.h says for aborts and fatal errors).
TT_API int32_t tt_decode(tt_target * t, int32_t n, const int32_t * tokens, const int32_t * pos, const int32_t * n_seq,
                         const int32_t * seq_ids, const int8_t * outputs) {
    if (n < 1 || n > t->n_batch) {
        return -100;
    }
    llama_batch & b = t->batch;
    b.n_tokens = n;
    const int32_t * ids = seq_ids;
    for (int32_t i = 0; i < n; ++i) {
        if (n_seq[i] < 1 || n_seq[i] > t->n_seq_max) {
            return -101;
        }
        b.token[i] = tokens[i];
        b.pos[i] = pos[i];
        b.n_seq_id[i] = n_seq[i];
        for (int32_t s = 0; s < n_seq[i]; ++s) {
            b.seq_id[i][s] = *ids++;
        }
        b.logits[i] = outputs[i];
    }
    return llama_decode(t->ctx, b);
}

// Copies the rows `get(index[i])` (each `width` floats, null: no such output) into out[n, width].
template <typename Get>
static int32_t copy_rows(int32_t n, const int32_t * index, int32_t width, float * out, Get get) {
    for (int32_t i = 0; i < n; ++i) {
        const float * row = get(index[i]);
        if (row == nullptr) {
            return -1;
        }
        std::memcpy(out + (size_t) i * width, row, sizeof(float) * (size_t) width);
    }
    return 0;
}

// Copies the logits of the last decode's batch entries `index[0..n)` (each an entry with an output) into
// out[n, n_vocab].
TT_API int32_t tt_logits(tt_target * t, int32_t n, const int32_t * index, float * out) {
    return copy_rows(n, index, t->n_vocab, out, [t](int32_t i) { return llama_get_logits_ith(t->ctx, i); });
}

// Copies the final norm's output at the last decode's entries `index[0..n)` into out[n, n_embd].
TT_API int32_t tt_final_hidden(tt_target * t, int32_t n, const int32_t * index, float * out) {
    return copy_rows(n, index, t->n_embd, out, [t](int32_t i) { return llama_get_embeddings_ith(t->ctx, i); });
}

// Copies the input of layer `layer` at the last decode's first `n` entries (every entry, outputs or not) into
// out[n, n_embd].
TT_API int32_t tt_layer_input(tt_target * t, int32_t layer, int32_t n, float * out) {
    const float * rows = llama_get_embeddings_layer_inp(t->ctx, (uint32_t) layer);
    if (rows == nullptr) {
        return -1;
    }
    std::memcpy(out, rows, sizeof(float) * (size_t) n * (size_t) t->n_embd);
    return 0;
}

// The cache's sequence bookkeeping (llama.h's llama_memory_seq_*): p0 < 0 and p1 < 0 mean the whole sequence.
TT_API int32_t tt_seq_rm(tt_target * t, int32_t seq, int32_t p0, int32_t p1) {
    return llama_memory_seq_rm(t->mem, seq, p0, p1) ? 1 : 0;
}
TT_API void tt_seq_cp(tt_target * t, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    llama_memory_seq_cp(t->mem, src, dst, p0, p1);
}
TT_API int32_t tt_seq_pos_max(tt_target * t, int32_t seq) { return llama_memory_seq_pos_max(t->mem, seq); }
TT_API void tt_clear(tt_target * t) { llama_memory_clear(t->mem, true); }
TT_API void tt_set_threads(tt_target * t, int32_t n_threads) { llama_set_n_threads(t->ctx, n_threads, n_threads); }
