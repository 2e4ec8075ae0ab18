// s2moe routing hook: the ggml scheduler eval callback (cb_eval) of an s2moe llama_context.
//
// llama.cpp names the routing tensors of every MoE layer L. We ask the scheduler to stop after
// "ffn_moe_weights-L" (get_rows(probs, topk)): at that point the router's argsort/top-k ids, the
// probabilities and the mixing weights are computed, and the expert matmuls that read the ids and
// the weights have not run yet. Rewriting ids and weights there changes which experts are used
// without patching llama.cpp. One decode runs in one of three modes:
//   observe: record the ids the router chose (and their probabilities);
//   draft:   record the router's full top-k (the predicted target routing), then keep only the
//            top-k_d experts: slots >= k_d repeat kept ids with a dropped weight, so the dropped
//            experts' weights are never read (with distinct_ids, see below, they read other experts);
//            with a residency mask (s2_hook_draft_masked), the top-k_d of the router's ranking among
//            the experts the mask allows and, with a residency callback (s2_hook_set_resident), that
//            are in memory as the layer routes (a draft that fetches nothing), each with its router
//            probability as weight; the router's own next choices where a layer has too few.
//            Repeated ids are not read again, but the CPU's MUL_MAT_ID computes every slot. Where it runs
//            on the CPU, a draft also lowers the ids view's slot count to k_d until the layer's down
//            matmul has run: MUL_MAT_ID loops over ids->ne[0] slots, so the dropped slots cost nothing,
//            and their rows of the down output, never written, are zeroed before they are weighted;
//   gate:    reuse-aware gating of a verification batch: bias each token's selection scores
//            toward the batch's preferred experts E*, mix with the unbiased probabilities; with a
//            memory preference (s2_hook_prefer_memory), also toward the experts already in memory,
//            which under a budget cost nothing to read, in every decode, a single row's too;
//   skip:    layer skipping: in the layers marked, every slot reads one given expert with weight 0,
//            so that the routed experts add nothing and no expert beyond that one is read.
// Uniform routing (s2_hook_uniform), over whatever mode is set: every slot of every layer reads expert 0
// with weight 0. For a warm-up that only builds graphs and touches buffers: the graphs are the same, and a
// model many times a memory budget is not read whole from storage for output that is thrown away.
// Pre-gating (s2_hook_pregate), in any mode but draft and skip, for one-row decodes: as layer L routes, the
// routers of layers L+1..L+depth are applied to L's input hidden state (ffn_inp-L, the residual stream after
// L's attention), and the experts they rank first go to on_predict, so that their reads are in flight while L
// computes. It reads ahead only: the ids the matmuls read are the router's (or the mode's) as before.
// Buffers are owned by the caller (numpy) and filled in place.
//
// Distinct ids: CUDA's MUL_MAT_ID counts each expert at most once per token while it sorts a batch's rows
// by expert (ggml_cuda_mul_mat_id asserts that the count adds up), so a row that names one expert twice
// aborts the process. Where MUL_MAT_ID may run on a GPU, the slots that would repeat an id take other
// experts instead, with the same dropped weight: first experts the batch already reads in that layer,
// then the router's own next choices. The output is unchanged (weight 0 adds +0.0); what is read grows.
// MUL_MAT_ID runs on a GPU when the layer's ids live in a device buffer, or, with op offload, when the
// batch has at least GGML_OP_OFFLOAD_MIN_BATCH rows (distinct_min_rows; 0: no GPU to offload to).

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml.h"

enum { S2_OFF = 0, S2_OBSERVE = 1, S2_DRAFT = 2, S2_GATE = 3, S2_SKIP = 4 };
// How the selection scores relate to the logits, so that gating margins are measured in logit space.
enum { S2_SCORE_RAW = 0, S2_SCORE_LOG = 1, S2_SCORE_LOGIT = 2 };

enum { PREGATE_MAX = 4 };  // layers ahead pre-gating may look

typedef struct s2_hook {
    int mode;
    int n_layer, n_expert, k, max_rows, cap_max;

    int k_draft;
    float drop_weight;   // 0, or -INFINITY where a softmax over the selected weights follows
    int score_space;
    int hook_argsort;    // selection scores are not the probabilities (bias/mask): copy them at argsort
    int distinct_min_rows; // from this many rows a batch may run on a GPU: no id twice in a row (top of file)
    int backend_copy;    // copy through ggml_backend_tensor_get/set even for host buffers (tests the
                         // path device buffers take on a machine that has none)
    int uniform;         // every slot reads expert 0 with weight 0, whatever the mode (top of file)

    float alpha;
    int cap;
    const float *row_weight;  // [max_rows] confidence weight of each verification row
    const int32_t *skip_expert;  // [n_layer] skip mode: the expert a skipped layer reads; -1: layer kept
    const uint8_t *draft_mask;   // [n_layer][n_expert] masked draft mode: the experts a draft may read; NULL: any
    float memory_alpha;          // gate mode: strength of the bias toward experts in memory (0: none)
    const uint8_t *memory_mask;  // [n_layer][n_expert] experts that count as in memory; NULL: ask is_resident

    // caller-owned outputs
    int32_t *orig;       // [n_layer][max_rows][k] the router's own top-k
    int32_t *used;       // [n_layer][max_rows][k] ids the expert matmuls read
    float *weight;       // [n_layer][max_rows][k] mixing weight of each used slot, before any norm
    int32_t *rows;       // [n_layer] rows seen in the last decode (0: layer not seen)
    int32_t *preferred;  // [n_layer][cap_max] E* of the last gated decode
    int32_t *n_preferred;// [n_layer]

    // Called once a layer's final expert ids are known, before its expert matmuls run: lets an
    // offloading helper ask the OS for exactly those experts' pages just in time.
    int (*on_route)(void *ctx, int layer, const int32_t *ids, int n);
    void *route_ctx;
    // Asked, in masked draft mode, whether an expert the mask allows is in memory at the moment the layer
    // routes: a mask is a snapshot, and the kernel may evict its pages before a later draft pass reads them.
    int (*is_resident)(void *ctx, int layer, int e);
    void *resident_ctx;
    // Called once a layer's expert matmul of one kind has run (0: up, 1: gate, 2: down): lets the
    // offloading helper read a layer's experts one part at a time when they do not fit in memory together.
    // Asked first (ask = 1) whether it wants that call: each call stops the graph there.
    int (*on_stage)(void *ctx, int layer, int kind, int ask);
    void *stage_ctx;

    // counters for diagnostics
    int64_t n_hooked;    // weight nodes handled since creation
    int64_t n_skipped;   // weight nodes with unexpected shapes (left untouched)
    int64_t n_mask_fallback; // masked drafts: kept slots the mask could not fill (the router's choice instead)
    int64_t n_narrowed;      // draft layers whose expert matmuls ran on k_d slots only
    int64_t n_unwidened;     // narrowed views whose down matmul never reached the hook (s2_hook_end)
    struct ggml_tensor **narrowed;  // [n_layer] the ids view narrowed for this decode, until its down matmul
    uint8_t *down_seen;      // [n_layer] a node named ffn_moe_down-L was in a graph: only then is L narrowed
    int stage_pending;       // the node the scheduler stopped at was asked for by on_stage too
    int64_t n_mask_evicted;  // masked drafts: experts the mask allowed that were found out of memory

    // scratch
    float *scores;       // [max_rows][n_expert] selection scores copied at the argsort node
    int scores_layer, scores_rows;
    float *probs;        // [max_rows][n_expert]
    int32_t *ranks;      // [max_rows][n_expert] full argsort rows
    float *w;            // [max_rows][k]
    float *importance;   // [n_expert]
    unsigned char *in_pref; // [n_expert]
    unsigned char *in_row;  // [n_expert] distinct ids: experts already named in the row being filled
    int32_t *pool;          // [n_expert] distinct ids: the experts a layer's batch reads, in first-use order
    int8_t *allowed;        // [n_expert] masked drafts: one layer's answers (-1: not asked yet)
    int8_t *in_memory;      // [n_expert] memory preference: one layer's answers (-1: not asked yet)
    int32_t *route_ids;     // [route_cap] ids of a batch routed without the hook acting on it
    size_t route_cap;

    // pre-gating (top of file); what it needs of each layer is learned from the nodes of the graphs it sees
    int pregate;            // layers ahead (0: off)
    int pregate_self;       // also the layer's own router (distance 0): checks the prediction itself
    int pregate_width;      // of a layer's k predicted experts, the first this many (best ranked) are read
    const struct ggml_tensor **router;   // [n_layer] ffn_gate_inp (the matmul ffn_moe_logits-L)
    const struct ggml_tensor **norm_w;   // [n_layer] ffn_norm's weight (NULL: none)
    float *norm_eps;                     // [n_layer] its rms_norm's eps (< 0: no rms_norm before it)
    const struct ggml_tensor **sel_bias; // [n_layer] selection bias added to the probabilities (NULL: none)
    uint8_t *sel_softmax;                // [n_layer] those probabilities are a softmax (else a sigmoid)
    struct ggml_tensor **hidden;         // [n_layer] ffn_inp-L of the graph running now (NULL: none yet)
    int32_t *predicted;     // caller-owned [PREGATE_MAX + 1][n_layer][k]: the experts predicted for layer l at
                            // distance d in this decode; -1 where none (the caller resets it before a decode)
    int64_t pg_hits[PREGATE_MAX + 1];    // per distance: predicted experts the layer then read
    int64_t pg_total[PREGATE_MAX + 1];   // per distance: experts read by layers that had a prediction
    int64_t n_pregate_decodes;           // decodes that pre-gated
    int pregated_now;                    // the decode running now has (counted at s2_hook_end)
    int pg_embd;
    float *pg_x, *pg_xn, *pg_row, *pg_score;  // scratch: [pg_embd] x3, [n_expert]
    int (*on_predict)(void *ctx, int layer, const int32_t *ids, int n);
    void *predict_ctx;
} s2_hook;

void s2_hook_free(s2_hook *h);

s2_hook *s2_hook_new(int n_layer, int n_expert, int k, int max_rows, int cap_max) {
    s2_hook *h = calloc(1, sizeof(*h));
    if (!h) return NULL;
    h->n_layer = n_layer;
    h->n_expert = n_expert;
    h->k = k;
    h->max_rows = max_rows;
    h->cap_max = cap_max;
    h->scores_layer = -1;
    size_t re = (size_t)max_rows * n_expert;
    h->scores = malloc(re * sizeof(float));
    h->probs = malloc(re * sizeof(float));
    h->ranks = malloc(re * sizeof(int32_t));
    h->w = malloc((size_t)max_rows * k * sizeof(float));
    h->importance = malloc(n_expert * sizeof(float));
    h->in_pref = malloc(n_expert);
    h->in_row = malloc(n_expert);
    h->pool = malloc(n_expert * sizeof(int32_t));
    h->allowed = malloc(n_expert);
    h->in_memory = malloc(n_expert);
    h->narrowed = calloc((size_t)n_layer, sizeof(struct ggml_tensor *));
    h->down_seen = calloc((size_t)n_layer, 1);
    h->router = calloc((size_t)n_layer, sizeof(*h->router));
    h->norm_w = calloc((size_t)n_layer, sizeof(*h->norm_w));
    h->norm_eps = malloc((size_t)n_layer * sizeof(float));
    h->sel_bias = calloc((size_t)n_layer, sizeof(*h->sel_bias));
    h->sel_softmax = calloc((size_t)n_layer, 1);
    h->hidden = calloc((size_t)n_layer, sizeof(*h->hidden));
    h->pg_score = malloc((size_t)n_expert * sizeof(float));
    if (!h->scores || !h->probs || !h->ranks || !h->w || !h->importance || !h->in_pref || !h->in_row || !h->pool ||
        !h->allowed || !h->in_memory || !h->narrowed || !h->down_seen || !h->router || !h->norm_w || !h->norm_eps ||
        !h->sel_bias || !h->sel_softmax || !h->hidden || !h->pg_score) {
        s2_hook_free(h);
        return NULL;
    }
    for (int l = 0; l < n_layer; ++l) h->norm_eps[l] = -1.0f;
    return h;
}

void s2_hook_free(s2_hook *h) {
    if (!h) return;
    free(h->scores); free(h->probs); free(h->ranks); free(h->w); free(h->importance); free(h->in_pref);
    free(h->in_row); free(h->pool); free(h->allowed); free(h->in_memory); free(h->route_ids); free(h->narrowed);
    free(h->down_seen);
    free(h->router); free(h->norm_w); free(h->norm_eps); free(h->sel_bias); free(h->sel_softmax); free(h->hidden);
    free(h->pg_x); free(h->pg_xn); free(h->pg_row); free(h->pg_score);
    free(h);
}

// After every decode, returned or failed: a view still narrowed (its down matmul never reached the hook) gets
// its k slots back while the graph that holds it is still allocated, before the graph is used again.
void s2_hook_end(s2_hook *h) {
    // a graph's ffn_inp tensors are its own: the next graph names its own
    memset(h->hidden, 0, (size_t)h->n_layer * sizeof(*h->hidden));
    h->n_pregate_decodes += h->pregated_now;
    h->pregated_now = 0;
    for (int l = 0; l < h->n_layer; ++l)
        if (h->narrowed[l]) {
            h->narrowed[l]->ne[0] = h->k;
            h->narrowed[l] = NULL;
            h->n_unwidened++;
        }
}

void s2_hook_bind(s2_hook *h, int32_t *orig, int32_t *used, float *weight, int32_t *rows,
                  int32_t *preferred, int32_t *n_preferred) {
    h->orig = orig;
    h->used = used;
    h->weight = weight;
    h->rows = rows;
    h->preferred = preferred;
    h->n_preferred = n_preferred;
}

void s2_hook_configure(s2_hook *h, float drop_weight, int score_space, int hook_argsort) {
    h->drop_weight = drop_weight;
    h->score_space = score_space;
    h->hook_argsort = hook_argsort;
}

void s2_hook_off(s2_hook *h) { h->mode = S2_OFF; }
void s2_hook_observe(s2_hook *h) { h->mode = S2_OBSERVE; }

void s2_hook_draft(s2_hook *h, int k_draft) {
    h->mode = S2_DRAFT;
    h->k_draft = k_draft;
    h->draft_mask = NULL;
}

// Draft mode restricted to the experts mask[layer][expert] != 0 (caller-owned, read at every draft decode).
void s2_hook_draft_masked(s2_hook *h, int k_draft, const uint8_t *mask) {
    s2_hook_draft(h, k_draft);
    h->draft_mask = mask;
}

void s2_hook_gate(s2_hook *h, float alpha, int cap, const float *row_weight) {
    h->mode = S2_GATE;
    h->alpha = alpha;
    h->cap = cap < h->cap_max ? cap : h->cap_max;
    h->row_weight = row_weight;
}

// Gate mode's bias toward experts in memory: alpha 0 turns it off. mask ([n_layer][n_expert], caller-owned,
// read at every gated decode) names them; without one, the residency callback (s2_hook_set_resident) is asked,
// and without that nothing counts as in memory.
void s2_hook_prefer_memory(s2_hook *h, float alpha, const uint8_t *mask) {
    h->memory_alpha = alpha > 0.0f ? alpha : 0.0f;
    h->memory_mask = mask;
}

void s2_hook_skip(s2_hook *h, const int32_t *skip_expert) {
    h->mode = S2_SKIP;
    h->skip_expert = skip_expert;
}

void s2_hook_uniform(s2_hook *h, int on) { h->uniform = on != 0; }

void s2_hook_set_route(s2_hook *h, int (*fn)(void *, int, const int32_t *, int), void *ctx) {
    h->on_route = fn;
    h->route_ctx = ctx;
}

void s2_hook_set_resident(s2_hook *h, int (*fn)(void *, int, int), void *ctx) {
    h->is_resident = fn;
    h->resident_ctx = ctx;
}

void s2_hook_set_stage(s2_hook *h, int (*fn)(void *, int, int, int), void *ctx) {
    h->on_stage = fn;
    h->stage_ctx = ctx;
}

// Pre-gating `depth` layers ahead (0: off, at most PREGATE_MAX), reading the `width` best ranked of each layer's k
// predicted experts (the first ranks are right far more often), and with `self` each layer's own router too (a
// check of the prediction: it must name what the layer then reads). predicted: caller-owned (top of file).
void s2_hook_pregate(s2_hook *h, int depth, int width, int self, int32_t *predicted) {
    h->pregate = depth < 0 ? 0 : depth > PREGATE_MAX ? PREGATE_MAX : depth;
    h->pregate_width = width < 1 || width > h->k ? h->k : width;
    h->pregate_self = self != 0;
    h->predicted = predicted;
    if (!h->pregate) memset(h->hidden, 0, (size_t)h->n_layer * sizeof(*h->hidden));
}

void s2_hook_set_predict(s2_hook *h, int (*fn)(void *, int, const int32_t *, int), void *ctx) {
    h->on_predict = fn;
    h->predict_ctx = ctx;
}

// Per distance (PREGATE_MAX + 1 each): predicted experts the layer then read, experts read where a prediction
// was made. Returns the decodes that pre-gated.
int64_t s2_hook_pregate_stats(const s2_hook *h, int64_t *hits, int64_t *total) {
    memcpy(hits, h->pg_hits, sizeof h->pg_hits);
    memcpy(total, h->pg_total, sizeof h->pg_total);
    return h->n_pregate_decodes;
}

void s2_hook_set_backend_copy(s2_hook *h, int on) { h->backend_copy = on; }
void s2_hook_set_distinct_min_rows(s2_hook *h, int min_rows) { h->distinct_min_rows = min_rows; }

int64_t s2_hook_hooked(const s2_hook *h) { return h->n_hooked; }
int64_t s2_hook_skipped(const s2_hook *h) { return h->n_skipped; }
int64_t s2_hook_mask_fallbacks(const s2_hook *h) { return h->n_mask_fallback; }
int64_t s2_hook_narrowed(const s2_hook *h) { return h->n_narrowed; }
int64_t s2_hook_unwidened(const s2_hook *h) { return h->n_unwidened; }
int64_t s2_hook_mask_evicted(const s2_hook *h) { return h->n_mask_evicted; }

// Masked drafts: whether expert e of layer may be read, i.e. the mask allows it and (with a residency
// callback) it is in memory now. Asked at most once per expert and decode of a layer.
static bool draft_allows(s2_hook *h, int layer, int e) {
    if (h->allowed[e] < 0) {
        h->allowed[e] = h->draft_mask[(size_t)layer * h->n_expert + e] != 0;
        if (h->allowed[e] && h->is_resident && !h->is_resident(h->resident_ctx, layer, e)) {
            h->allowed[e] = 0;
            h->n_mask_evicted++;
        }
    }
    return h->allowed[e];
}

// Memory preference: whether expert e of layer is in memory now. Asked at most once per expert and decode of
// a layer, and only about experts the bias could move into a row's top-k.
static bool in_memory(s2_hook *h, int layer, int e) {
    if (h->in_memory[e] < 0) {
        if (h->memory_mask) h->in_memory[e] = h->memory_mask[(size_t)layer * h->n_expert + e] != 0;
        else h->in_memory[e] = h->is_resident && h->is_resident(h->resident_ctx, layer, e);
    }
    return h->in_memory[e];
}

static bool prefers_memory(const s2_hook *h) { return h->memory_alpha > 0.0f && (h->memory_mask || h->is_resident); }

// Returns the layer index if name is exactly prefix followed by a decimal number, else -1.
static int layer_of(const char *name, const char *prefix, size_t prefix_len) {
    if (strncmp(name, prefix, prefix_len) != 0) return -1;
    const char *p = name + prefix_len;
    if (*p < '0' || *p > '9') return -1;
    int layer = 0;
    for (; *p; ++p) {
        if (*p < '0' || *p > '9') return -1;
        layer = layer * 10 + (*p - '0');
    }
    return layer;
}

static const char WEIGHTS[] = "ffn_moe_weights-";
static const char UP[] = "ffn_moe_up-", GATE[] = "ffn_moe_gate-", DOWN[] = "ffn_moe_down-";
static const struct { const char *prefix; size_t len; } STAGES[3] = {
    {UP, sizeof(UP) - 1}, {GATE, sizeof(GATE) - 1}, {DOWN, sizeof(DOWN) - 1}};
static const char ARGSORT[] = "ffn_moe_argsort-";

static struct ggml_backend_buffer *buffer_of(const struct ggml_tensor *t) {
    return t->view_src ? t->view_src->buffer : t->buffer;
}

static bool on_host(const s2_hook *h, const struct ggml_tensor *t) {
    if (h->backend_copy) return false;
    struct ggml_backend_buffer *b = buffer_of(t);
    return b == NULL || ggml_backend_buffer_is_host(b);
}

// Copies a [n_cols, n_rows] f32 tensor (any row stride, contiguous rows) into dst.
static void read_f32_rows(const s2_hook *h, const struct ggml_tensor *t, int n_cols, int n_rows, size_t row_stride,
                          float *dst) {
    if (on_host(h, t)) {
        for (int r = 0; r < n_rows; ++r)
            memcpy(dst + (size_t)r * n_cols, (const char *)t->data + r * row_stride, n_cols * sizeof(float));
    } else {
        for (int r = 0; r < n_rows; ++r)
            ggml_backend_tensor_get(t, dst + (size_t)r * n_cols, r * row_stride, n_cols * sizeof(float));
    }
}

static void on_argsort(s2_hook *h, struct ggml_tensor *t, int layer) {
    const struct ggml_tensor *src = t->src[0];
    if (!src || src->type != GGML_TYPE_F32 || src->ne[0] != h->n_expert || src->ne[1] > h->max_rows) return;
    read_f32_rows(h, src, h->n_expert, (int)src->ne[1], src->nb[1], h->scores);
    h->scores_layer = layer;
    h->scores_rows = (int)src->ne[1];
}

static float to_logit_space(const s2_hook *h, float s) {
    switch (h->score_space) {
        case S2_SCORE_LOG: return logf(s > 1e-30f ? s : 1e-30f);
        case S2_SCORE_LOGIT: {
            float p = s < 1e-7f ? 1e-7f : (s > 1.0f - 1e-7f ? 1.0f - 1e-7f : s);
            return logf(p / (1.0f - p));
        }
        default: return s;
    }
}

// Reuse-aware gating of one layer of a verification batch (rows = tokens): toward E*, the experts the batch
// needs most (batches of two rows or more, alpha > 0), and toward the experts in memory (memory_alpha > 0).
static void gate_layer(s2_hook *h, int layer, int n_rows, int32_t *ids /* [n_rows][k] in/out */) {
    const int ne = h->n_expert, k = h->k;
    const bool own_scores = h->hook_argsort && h->scores_layer == layer && h->scores_rows == n_rows;
    const bool batch = h->alpha > 0.0f && n_rows > 1;
    const bool memory = prefers_memory(h);

    // Importance of each expert to the batch: confidence-weighted, per-token-normalised probabilities.
    memset(h->importance, 0, ne * sizeof(float));
    for (int r = 0; batch && r < n_rows; ++r) {
        const float *p = h->probs + (size_t)r * ne;
        float total = 0.0f;
        for (int e = 0; e < ne; ++e) total += p[e] > 0.0f ? p[e] : 0.0f;
        if (!(total > 0.0f)) continue;
        const float wr = h->row_weight ? h->row_weight[r] : 1.0f;
        for (int e = 0; e < ne; ++e) h->importance[e] += wr * (p[e] > 0.0f ? p[e] : 0.0f) / total;
    }

    // E* = the cap most important experts.
    memset(h->in_pref, 0, ne);
    int n_pref = 0;
    int32_t *pref = h->preferred + (size_t)layer * h->cap_max;
    for (; batch && n_pref < h->cap; ++n_pref) {
        int best = -1;
        for (int e = 0; e < ne; ++e)
            if (!h->in_pref[e] && (best < 0 || h->importance[e] > h->importance[best])) best = e;
        if (best < 0) break;
        h->in_pref[best] = 1;
        pref[n_pref] = best;
    }
    h->n_preferred[layer] = n_pref;
    memset(h->in_memory, -1, ne);

    for (int r = 0; r < n_rows; ++r) {
        const int32_t *rank = h->ranks + (size_t)r * ne;
        float *ell = h->scores + (size_t)r * ne;  // logit-space selection scores of this row
        if (!own_scores)
            for (int e = 0; e < ne; ++e) ell[e] = to_logit_space(h, h->probs[(size_t)r * ne + e]);
        if (k >= ne) continue;
        const float margin = ell[rank[0]] - ell[rank[k]];
        const float lambda = batch ? h->alpha * margin : 0.0f;
        const float lambda_memory = memory ? h->memory_alpha * margin : 0.0f;
        const float reach = lambda > lambda_memory ? lambda : lambda_memory;
        if (!isfinite(reach) || reach <= 0.0f) continue;
        // No bias lifts an expert scored below the row's k-th by more than the largest bias into the top-k:
        // the others are never asked about (a residency check costs a system call).
        const float floor = ell[rank[k - 1]] - reach;

        // top-k of the biased scores, ties resolved by the router's own order
        int32_t chosen[64];
        int n_chosen = 0;
        bool changed = false;
        unsigned char taken_local[1024];
        unsigned char *taken = ne <= 1024 ? taken_local : NULL;
        if (!taken || k > 64) continue;
        memset(taken, 0, ne);
        for (int j = 0; j < k; ++j) {
            int best = -1;
            float best_score = -INFINITY;
            for (int q = 0; q < ne; ++q) {
                const int e = rank[q];
                // (not a break: where the router selects by biased scores, rank need not follow ell)
                if (taken[e] || !(ell[e] >= floor)) continue;
                float bias = h->in_pref[e] ? lambda : 0.0f;
                if (memory && bias < lambda_memory && in_memory(h, layer, e)) bias = lambda_memory;
                const float s = ell[e] + bias;
                if (best < 0 || s > best_score) { best = e; best_score = s; }
            }
            if (best < 0) break;
            taken[best] = 1;
            chosen[n_chosen++] = best;
        }
        if (n_chosen < k) continue;
        for (int j = 0; j < k; ++j) changed |= !taken[ids[(size_t)r * k + j]];
        if (!changed) continue;  // same set: keep the router's slot order (bit-identical mixing)
        for (int j = 0; j < k; ++j) ids[(size_t)r * k + j] = chosen[j];
    }
}

// Slots [keep, k) of each row get experts not yet named in that row, preferring the pool
// (experts the batch reads anyway), then the row's own router choices (k distinct ids, so one is always
// free), then any expert.
static void fill_distinct(s2_hook *h, int32_t *used, const int32_t *orig, int n_rows, int keep,
                          const int32_t *pool, int n_pool) {
    const int k = h->k, ne = h->n_expert;
    for (int r = 0; r < n_rows; ++r) {
        int32_t *row = used + (size_t)r * k;
        memset(h->in_row, 0, ne);
        for (int j = 0; j < keep; ++j) h->in_row[row[j]] = 1;
        int next_pool = 0, next_orig = 0, next_any = 0;
        for (int j = keep; j < k; ++j) {
            int32_t e = -1;
            while (e < 0 && next_pool < n_pool)
                if (!h->in_row[pool[next_pool++]]) e = pool[next_pool - 1];
            while (e < 0 && next_orig < k)
                if (!h->in_row[orig[(size_t)r * k + next_orig++]]) e = orig[(size_t)r * k + next_orig - 1];
            while (e < 0 && next_any < ne)
                if (!h->in_row[next_any++]) e = next_any - 1;
            row[j] = e;
            h->in_row[e] = 1;
        }
    }
}

// Masked draft of one layer: each row keeps, in its first k_d slots, the router's best-ranked experts that
// the mask allows, in rank order, then (too few allowed) the best-ranked others. Returns whether any kept
// slot differs from the router's.
static bool mask_layer(s2_hook *h, int layer, int n_rows, int32_t *used) {
    const int k = h->k, ne = h->n_expert, kd = h->k_draft;
    bool changed = false;
    for (int r = 0; r < n_rows; ++r) {
        const int32_t *rank = h->ranks + (size_t)r * ne;
        int32_t *row = used + (size_t)r * k;
        int n = 0;
        for (int q = 0; q < ne && n < kd; ++q)
            if (draft_allows(h, layer, rank[q])) row[n++] = rank[q];
        for (int q = 0; q < ne && n < kd; ++q)
            if (!draft_allows(h, layer, rank[q])) { row[n++] = rank[q]; h->n_mask_fallback++; }
        for (int j = 0; j < kd; ++j) changed |= row[j] != rank[j];
    }
    return changed;
}

// Pre-gating learns what it needs of each layer from the graph's own nodes as the scheduler asks about them:
// the router (ffn_moe_logits-L is its matmul), the norm before it (ffn_norm-L: rms_norm then its weight), a
// selection bias (ffn_moe_probs_biased-L: the probabilities plus the bias), and, in every graph, the input
// hidden state (ffn_inp-L). Weights stay where llama.cpp keeps them (pinned with the other non-expert weights);
// ffn_inp-L stays allocated until the residual add after the layer's experts, so it is read as the layer routes,
// without a graph stop of its own.
static const char FFN_INP[] = "ffn_inp-", FFN_NORM[] = "ffn_norm-", LOGITS[] = "ffn_moe_logits-",
                  PROBS_BIASED[] = "ffn_moe_probs_biased-";

static void pregate_learn(s2_hook *h, struct ggml_tensor *t) {
    const char *name = t->name;
    int l;
    if ((l = layer_of(name, FFN_INP, sizeof(FFN_INP) - 1)) >= 0) {
        if (l < h->n_layer) h->hidden[l] = t;
    } else if ((l = layer_of(name, FFN_NORM, sizeof(FFN_NORM) - 1)) >= 0) {
        const struct ggml_tensor *w = t->src[1], *norm = t->src[0];
        if (l >= h->n_layer || t->op != GGML_OP_MUL || !w || !norm || w->type != GGML_TYPE_F32 || w->ne[0] != t->ne[0])
            return;
        h->norm_w[l] = w;
        if (norm->op == GGML_OP_RMS_NORM) memcpy(&h->norm_eps[l], norm->op_params, sizeof(float));
    } else if ((l = layer_of(name, LOGITS, sizeof(LOGITS) - 1)) >= 0) {
        if (l < h->n_layer && t->op == GGML_OP_MUL_MAT && t->src[0] && t->src[0]->ne[1] == h->n_expert)
            h->router[l] = t->src[0];
    } else if ((l = layer_of(name, PROBS_BIASED, sizeof(PROBS_BIASED) - 1)) >= 0) {
        const struct ggml_tensor *b = t->src[1];
        if (l >= h->n_layer || t->op != GGML_OP_ADD || !b || b->type != GGML_TYPE_F32 || b->ne[0] != h->n_expert)
            return;
        h->sel_bias[l] = b;
        h->sel_softmax[l] = t->src[0] && t->src[0]->op == GGML_OP_SOFT_MAX;
    }
}

// A weight read in place: llama.cpp's own host copy (a device copy would cost a transfer per token).
static bool host_weight(const struct ggml_tensor *t) {
    struct ggml_backend_buffer *b = buffer_of(t);
    return b && ggml_backend_buffer_is_host(b) && t->data;
}

// Whether layer's router can be applied here: learned, on the host, one row per expert of pg_embd values.
static bool router_usable(const s2_hook *h, int layer) {
    const struct ggml_tensor *w = h->router[layer];
    return w && host_weight(w) && w->ne[0] == h->pg_embd && w->ne[1] == h->n_expert &&
           (w->type == GGML_TYPE_F32 || ggml_get_type_traits(w->type)->to_float != NULL);
}

// Eight sums side by side: the compiler vectorises them (one sum it may not reorder), 17x faster on a 2048 x 128
// router, which a large model applies to two layers ahead in each of its 48.
static float dot(const float *a, const float *b, int n) {
    float part[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (; i < n; ++i) sum += a[i] * b[i];
    for (int j = 0; j < 8; ++j) sum += part[j];
    return sum;
}

// The k experts layer's router ranks first for the hidden state in pg_x, into out, best first.
static void predict_layer(s2_hook *h, int layer, int32_t *out) {
    const int n = h->pg_embd, ne = h->n_expert, k = h->k;
    float scale = 1.0f;
    if (h->norm_eps[layer] >= 0.0f) {
        double ss = 0.0;
        for (int i = 0; i < n; ++i) ss += (double)h->pg_x[i] * h->pg_x[i];
        scale = 1.0f / sqrtf((float)(ss / n) + h->norm_eps[layer]);
    }
    const struct ggml_tensor *g = h->norm_w[layer];
    const float *gamma = g && host_weight(g) && g->ne[0] == n ? g->data : NULL;
    for (int i = 0; i < n; ++i) h->pg_xn[i] = h->pg_x[i] * scale * (gamma ? gamma[i] : 1.0f);
    const struct ggml_tensor *w = h->router[layer];
    const ggml_to_float_t to_float = w->type == GGML_TYPE_F32 ? NULL : ggml_get_type_traits(w->type)->to_float;
    for (int e = 0; e < ne; ++e) {
        const void *row = (const char *)w->data + (size_t)e * w->nb[1];
        const float *r = row;
        if (to_float) {
            to_float(row, h->pg_row, n);
            r = h->pg_row;
        }
        h->pg_score[e] = dot(r, h->pg_xn, n);
    }
    // Without a bias the ranking is the logits' (softmax and sigmoid keep their order); with one, the selection
    // adds it to the probabilities.
    const struct ggml_tensor *b = h->sel_bias[layer];
    if (b && host_weight(b)) {
        const float *bias = b->data;
        float top = -INFINITY, sum = 0.0f;
        for (int e = 0; e < ne; ++e) top = h->pg_score[e] > top ? h->pg_score[e] : top;
        for (int e = 0; e < ne; ++e) {
            h->pg_score[e] = h->sel_softmax[layer] ? expf(h->pg_score[e] - top) : 1.0f / (1.0f + expf(-h->pg_score[e]));
            sum += h->pg_score[e];
        }
        for (int e = 0; e < ne; ++e)
            h->pg_score[e] = (h->sel_softmax[layer] ? h->pg_score[e] / sum : h->pg_score[e]) + bias[e];
    }
    memset(h->in_row, 0, ne);
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < ne; ++e)
            if (!h->in_row[e] && (best < 0 || h->pg_score[e] > h->pg_score[best])) best = e;
        h->in_row[best] = 1;
        out[j] = best;
    }
}

static int32_t *predicted_for(const s2_hook *h, int distance, int layer) {
    return h->predicted + ((size_t)distance * h->n_layer + layer) * h->k;
}

static bool scratch_for(s2_hook *h, int n_embd) {
    if (h->pg_embd == n_embd) return true;
    const size_t bytes = (size_t)n_embd * sizeof(float);
    float *x = realloc(h->pg_x, bytes);
    if (x) h->pg_x = x;
    float *xn = x ? realloc(h->pg_xn, bytes) : NULL;
    if (xn) h->pg_xn = xn;
    float *row = xn ? realloc(h->pg_row, bytes) : NULL;
    if (row) h->pg_row = row;
    h->pg_embd = row ? n_embd : 0;
    return row != NULL;
}

// A one-row decode's layer has routed (ids: the k experts its matmuls read, just handed to on_route): the next
// layers' routers are applied to its input hidden state and their choices handed to on_predict; then this
// layer's ids are scored against what earlier layers predicted for it.
static void pregate_layer(s2_hook *h, int layer, const int32_t *ids) {
    if (!h->pregate || !h->predicted || h->mode == S2_DRAFT || h->mode == S2_SKIP || layer >= h->n_layer) return;
    const struct ggml_tensor *x = h->hidden[layer];
    h->hidden[layer] = NULL;
    const bool readable = x && (on_host(h, x) ? x->data != NULL : buffer_of(x) != NULL);
    if (readable && x->type == GGML_TYPE_F32 && x->ne[1] == 1 && scratch_for(h, (int)x->ne[0])) {
        if (on_host(h, x)) memcpy(h->pg_x, x->data, (size_t)h->pg_embd * sizeof(float));
        else ggml_backend_tensor_get(x, h->pg_x, 0, (size_t)h->pg_embd * sizeof(float));
        for (int d = 1; d <= h->pregate + 1; ++d) {
            const int distance = d <= h->pregate ? d : 0;  // its own router last: a check, not a read
            const int target = layer + distance;
            if ((distance == 0 && !h->pregate_self) || target >= h->n_layer || !router_usable(h, target)) continue;
            int32_t *out = predicted_for(h, distance, target);
            predict_layer(h, target, out);
            if (distance > 0 && h->on_predict) h->on_predict(h->predict_ctx, target, out, h->pregate_width);
        }
        h->pregated_now = 1;
    }
    for (int d = 0; d <= PREGATE_MAX; ++d) {
        const int32_t *p = predicted_for(h, d, layer);
        if (p[0] < 0) continue;
        for (int j = 0; j < h->k; ++j)
            for (int q = 0; q < h->k; ++q)
                if (p[q] == ids[j]) {
                    h->pg_hits[d]++;
                    break;
                }
        h->pg_total[d] += h->k;
    }
}

// A batch the hook does not act on (the hook off, or more rows than it records: a prompt's prefill) reads
// experts all the same: its ids go to the offloading helper too, so that every expert read passes through it
// (its just-in-time reads, its miss count, the expert cache it keeps).
static void route_only(s2_hook *h, struct ggml_tensor *t, int layer) {
    struct ggml_tensor *topk = t->src[1];
    const int k = h->k;
    if ((!h->on_route && !h->pregate) || !topk || layer < 0 || layer >= h->n_layer || topk->type != GGML_TYPE_I32 ||
        topk->ne[0] != k)
        return;
    const int n_rows = (int)topk->ne[1];
    const size_t need = (size_t)n_rows * k;
    if (need > h->route_cap) {
        int32_t *grown = realloc(h->route_ids, need * sizeof(int32_t));
        if (!grown) return;
        h->route_ids = grown;
        h->route_cap = need;
    }
    const bool host_ids = on_host(h, topk);
    const struct ggml_tensor *src = topk->view_src ? topk->view_src : topk;
    const size_t offs = topk->view_src ? topk->view_offs : 0;
    for (int r = 0; r < n_rows; ++r) {
        int32_t *dst = h->route_ids + (size_t)r * k;
        if (host_ids) memcpy(dst, (const char *)topk->data + r * topk->nb[1], k * sizeof(int32_t));
        else ggml_backend_tensor_get(src, dst, offs + r * topk->nb[1], k * sizeof(int32_t));
    }
    if (h->on_route) h->on_route(h->route_ctx, layer, h->route_ids, n_rows * k);
    if (n_rows == 1) pregate_layer(h, layer, h->route_ids);
}

static void on_weights(s2_hook *h, struct ggml_tensor *t, int layer) {
    struct ggml_tensor *probs = t->src[0];  // [1, n_expert, T] view of the probabilities
    struct ggml_tensor *topk = t->src[1];   // [k, T] i32, a view of the full argsort
    const int k = h->k, ne = h->n_expert;
    if (!probs || !topk || layer >= h->n_layer || topk->type != GGML_TYPE_I32 || t->type != GGML_TYPE_F32 ||
        topk->ne[0] != k || probs->ne[1] != ne || probs->type != GGML_TYPE_F32 || topk->ne[1] > h->max_rows ||
        t->ne[1] != k) {
        h->n_skipped++;
        route_only(h, t, layer);
        return;
    }
    const int n_rows = (int)topk->ne[1];
    const size_t id_stride = topk->nb[1];
    const bool uniform = h->uniform;
    const bool drafting = !uniform && h->mode == S2_DRAFT && h->k_draft > 0 && h->k_draft < k;
    const bool masked = drafting && h->draft_mask;
    const bool need_ranks = !uniform && (h->mode == S2_GATE || masked);
    // Full argsort rows when gating (the (k+1)-th choice sets the margin) or drafting among a mask (its
    // best allowed experts may rank anywhere), else only the top-k slots.
    const int id_cols = need_ranks && id_stride >= (size_t)ne * sizeof(int32_t) ? ne : k;
    if (need_ranks && id_cols != ne) { h->n_skipped++; return; }

    const bool host_ids = on_host(h, topk);
    // A full argsort row reaches past the end of the [k, T] view on its last row, and the backend copy
    // checks bounds against the tensor it is given: read device rows from the argsort itself.
    const struct ggml_tensor *rank_src = topk->view_src ? topk->view_src : topk;
    const size_t rank_offs = topk->view_src ? topk->view_offs : 0;
    for (int r = 0; r < n_rows; ++r) {
        int32_t *dst = h->ranks + (size_t)r * ne;
        if (host_ids) memcpy(dst, (const char *)topk->data + r * id_stride, id_cols * sizeof(int32_t));
        else ggml_backend_tensor_get(rank_src, dst, rank_offs + r * id_stride, id_cols * sizeof(int32_t));
    }
    const size_t w_stride = t->nb[2];
    read_f32_rows(h, t, k, n_rows, w_stride, h->w);

    int32_t *orig = h->orig + (size_t)layer * h->max_rows * k;
    int32_t *used = h->used + (size_t)layer * h->max_rows * k;
    float *weight = h->weight + (size_t)layer * h->max_rows * k;
    for (int r = 0; r < n_rows; ++r)
        memcpy(orig + (size_t)r * k, h->ranks + (size_t)r * ne, k * sizeof(int32_t));
    memcpy(used, orig, (size_t)n_rows * k * sizeof(int32_t));

    struct ggml_backend_buffer *ids_buffer = buffer_of(topk);
    const bool distinct = (ids_buffer && !ggml_backend_buffer_is_host(ids_buffer)) ||
                          (h->distinct_min_rows > 0 && n_rows >= h->distinct_min_rows);
    bool rewrite = false;
    if (drafting) {
        if (masked) memset(h->allowed, -1, ne);
        if (masked && mask_layer(h, layer, n_rows, used)) {
            // a kept expert the router did not put in that slot weighs what the router gives it
            read_f32_rows(h, probs, ne, n_rows, probs->nb[2], h->probs);
            for (int r = 0; r < n_rows; ++r)
                for (int j = 0; j < h->k_draft; ++j) {
                    const int32_t e = used[(size_t)r * k + j];
                    if (e != orig[(size_t)r * k + j]) h->w[(size_t)r * k + j] = h->probs[(size_t)r * ne + e];
                }
        }
        for (int r = 0; r < n_rows; ++r)
            for (int j = h->k_draft; j < k; ++j) {
                used[(size_t)r * k + j] = used[(size_t)r * k + j % h->k_draft];
                h->w[(size_t)r * k + j] = h->drop_weight;
            }
        // no GPU its matmuls could run on, and a down matmul of a name the hook knows, seen in an earlier graph
        if (!distinct && host_ids && h->distinct_min_rows == 0 && h->down_seen[layer]) {
            topk->ne[0] = h->k_draft;
            h->narrowed[layer] = topk;
            h->n_narrowed++;
        }
        if (distinct) {
            int n_pool = 0;
            memset(h->in_row, 0, ne);
            for (int r = 0; r < n_rows; ++r)
                for (int j = 0; j < h->k_draft; ++j) {
                    const int32_t e = used[(size_t)r * k + j];
                    if (!h->in_row[e]) { h->in_row[e] = 1; h->pool[n_pool++] = e; }
                }
            if (masked)  // then the other experts in memory: a masked draft's fillers fetch nothing either
                for (int e = 0; e < ne; ++e)
                    if (!h->in_row[e] && draft_allows(h, layer, e)) { h->in_row[e] = 1; h->pool[n_pool++] = e; }
            fill_distinct(h, used, orig, n_rows, h->k_draft, h->pool, n_pool);
        }
        rewrite = true;
    } else if (uniform || (h->mode == S2_SKIP && h->skip_expert[layer] >= 0 && h->skip_expert[layer] < ne)) {
        const int32_t only = uniform ? 0 : h->skip_expert[layer];
        // weight 0 (not drop_weight: a softmax over all-(-inf) weights has no value)
        for (int r = 0; r < n_rows; ++r)
            for (int j = 0; j < k; ++j) {
                used[(size_t)r * k + j] = only;
                h->w[(size_t)r * k + j] = 0.0f;
            }
        // One shared set for every row: the skipped layer reads k experts instead of one.
        if (distinct) fill_distinct(h, used, used, n_rows, 1, NULL, 0);
        rewrite = true;
    } else if (!uniform && h->mode == S2_GATE && ((h->alpha > 0.0f && n_rows > 1) || prefers_memory(h))) {
        read_f32_rows(h, probs, ne, n_rows, probs->nb[2], h->probs);
        gate_layer(h, layer, n_rows, used);
        for (int r = 0; r < n_rows; ++r)
            for (int j = 0; j < k; ++j) {
                const int32_t e = used[(size_t)r * k + j];
                if (e != orig[(size_t)r * k + j]) {
                    h->w[(size_t)r * k + j] = h->probs[(size_t)r * ne + e];
                    rewrite = true;
                }
            }
    }

    if (rewrite) {
        for (int r = 0; r < n_rows; ++r) {
            if (host_ids) memcpy((char *)topk->data + r * id_stride, used + (size_t)r * k, k * sizeof(int32_t));
            else ggml_backend_tensor_set(topk, used + (size_t)r * k, r * id_stride, k * sizeof(int32_t));
            if (on_host(h, t)) memcpy((char *)t->data + r * w_stride, h->w + (size_t)r * k, k * sizeof(float));
            else ggml_backend_tensor_set(t, h->w + (size_t)r * k, r * w_stride, k * sizeof(float));
        }
    }
    memcpy(weight, h->w, (size_t)n_rows * k * sizeof(float));
    if (h->on_route) h->on_route(h->route_ctx, layer, used, n_rows * k);
    if (n_rows == 1) pregate_layer(h, layer, used);
    h->rows[layer] = n_rows;
    h->n_hooked++;
}

// A narrowed draft layer's down matmul has run on its k_d slots: zero the rows of the others (never
// written: whatever the buffer held) and give the ids view its k slots back for the graph's next use.
static void widen_after_down(s2_hook *h, struct ggml_tensor *down, int layer) {
    struct ggml_tensor *topk = h->narrowed[layer];
    const int kd = (int)topk->ne[0];
    topk->ne[0] = h->k;
    h->narrowed[layer] = NULL;
    for (int64_t r = 0; r < down->ne[2]; ++r)
        for (int j = kd; j < down->ne[1]; ++j)
            memset((char *)down->data + r * down->nb[2] + j * down->nb[1], 0, (size_t)down->ne[0] * down->nb[0]);
}

// The cb_eval. ask=true: do we want this node's data? ask=false: the node is computed.
bool s2_hook_eval(struct ggml_tensor *t, bool ask, void *user_data) {
    s2_hook *h = user_data;
    // off, the hook still passes each layer's ids to an offloading helper and pre-gates (route_only)
    if (h->mode == S2_OFF && !h->on_route && !h->pregate && !h->uniform) return ask ? false : true;
    const char *name = t->name;
    if (h->pregate && ask && name[0] == 'f' && name[1] == 'f') pregate_learn(h, t);
    if (name[0] != 'f' || name[1] != 'f' || name[4] != 'm') return ask ? false : true;
    int layer;
    for (int kind = 0; kind < 3; ++kind) {
        layer = layer_of(name, STAGES[kind].prefix, STAGES[kind].len);
        if (layer < 0) continue;
        const bool down = STAGES[kind].prefix == DOWN && layer < h->n_layer;
        const bool narrowed = down && h->narrowed[layer];
        if (ask) {
            if (down) h->down_seen[layer] = 1;
            h->stage_pending = h->on_stage && h->on_stage(h->stage_ctx, layer, kind, 1) != 0;
            return h->stage_pending || narrowed;
        }
        if (narrowed) widen_after_down(h, t, layer);
        if (h->stage_pending) h->on_stage(h->stage_ctx, layer, kind, 0);
        h->stage_pending = 0;
        return true;
    }
    layer = layer_of(name, WEIGHTS, sizeof(WEIGHTS) - 1);
    if (layer >= 0) {
        if (!ask) {
            if (h->mode == S2_OFF && !h->uniform) route_only(h, t, layer);
            else on_weights(h, t, layer);
        }
        return true;
    }
    if (h->mode == S2_GATE && h->hook_argsort) {
        layer = layer_of(name, ARGSORT, sizeof(ARGSORT) - 1);
        if (layer >= 0) {
            if (!ask && layer < h->n_layer) on_argsort(h, t, layer);
            return true;
        }
    }
    // Never return false from ask=false: the scheduler would silently stop the graph.
    return ask ? false : true;
}
