// s2moe expert prefetch: ask the OS to read exactly the byte ranges of chosen experts (madvise WILLNEED)
// in a read-only shared mapping of the model file.
//
// Why: when llama.cpp's mmap'd expert pages are not resident, each page fault makes the kernel read a
// whole read-around window (read_ahead_kb, often 128 KiB but up to MiBs) centred on the fault, which
// overfetches neighbouring experts and fills a tight memory budget with pages nobody asked for.
// madvise(WILLNEED) on the exact ranges starts the reads of what will be used, and only that.
// Called from Python before a verification (the draft's predicted experts), and small enough to be
// called from the routing hook the moment a layer's top-k ids are known.
//
// The same callback counts the experts that are not wholly in memory at that moment (mincore of their
// own ranges), so an offloaded verification knows how many of its experts had to be fetched without a
// walk over the whole mapping: on a model of tens of GiB that walk costs milliseconds per token.

#define _GNU_SOURCE  // madvise, MADV_WILLNEED, pread and posix_fadvise under -std=c11
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef struct s2_fetcher s2_fetcher;
typedef struct s2_cache s2_cache;
typedef struct s2_streamer s2_streamer;

typedef struct s2_prefetch {
    uint8_t *base;        // start of our mapping of the model file
    size_t size;          // its length
    int n_layer, n_expert, n_parts;
    int64_t *ranges;      // [n_layer][n_expert][n_parts][2] (file offset, length); a copy
    uint8_t *mark;        // [n_expert] scratch: ids already advised in this call
    uint8_t *front;       // [n_expert] scratch: ids among the call's first `lead` (the row sure to be kept)
    int lead;             // ids of a call read by the row whose output is kept whatever the verification
                          // decides (its first row); 0: every id (a plain step, a prompt's prefill)
    size_t page;
    int64_t n_calls, n_advised, bytes_advised;
    int advise;           // madvise(WILLNEED) the experts; 0: only count misses
    int32_t *misses;      // [n_layer] caller-owned: per layer, the distinct experts that were not wholly in
                          // memory when the layer's ids became final (NULL: not counted)
    unsigned char *vec;   // mincore scratch, one byte per page of the longest expert range
    const uint8_t *ahead; // [n_layer][n_expert] caller-owned: experts the coming decode is predicted to read
                          // (a verification's, from the draft); when layer L routes, layer L+1's are
                          // advised too, so that its reads overlap layer L's matmuls (NULL: none)
    s2_fetcher *fetcher;  // background reads of a verification's predicted experts (NULL: none)
    s2_cache *cache;      // the expert cache this process keeps itself under a budget (NULL: the kernel's)
    // Staged reads: a layer whose fetched experts take more than stage_room bytes is read one part at a time,
    // in the order its matmuls use them, each part dropped once used.
    int kind_part[3];     // the part holding each kind of matrix (0 up, 1 gate, 2 down); -1: not staged
    int order[3], n_order;// the kinds in the order a layer's matmuls ran, learned from the first layer seen
    int learn_layer;
    int stage_part[3];    // the part read at each stage, once the order is known; -1 before
    int kind_stage[3];    // the stage at which the matmul of each kind runs
    int64_t stage_room;
    int staged_layer;     // the layer being read part by part, or -1
    uint8_t *staged;      // [n_expert] its experts read part by part
    int64_t n_staged;     // layers read part by part
    // Parts that alone outgrow stage_room (a prompt's prefill routes nearly every expert) are streamed by a
    // thread of ours (see ask_part). Only where a fault reads single pages (MADV_RANDOM).
    int stream;
    s2_streamer *streamer;        // NULL until the first span is streamed
    int64_t n_streamed;           // spans streamed
    // Pre-gating (s2_prefetch_predicted): experts read because a layer's router, applied early, predicted them
    uint8_t *pending;             // [n_layer][n_expert] read on a prediction, their layer not routed since (NULL
                                  // until the first prediction)
    int64_t pg_read, pg_read_bytes, pg_used, pg_used_bytes, pg_wasted, pg_wasted_bytes;
} s2_prefetch;

s2_prefetch *s2_prefetch_new(void *base, size_t size, int n_layer, int n_expert, int n_parts, const int64_t *ranges) {
    if (!base || n_layer <= 0 || n_expert <= 0 || n_parts <= 0 || !ranges) return NULL;
    s2_prefetch *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    const size_t n = (size_t)n_layer * n_expert * n_parts * 2;
    p->ranges = malloc(n * sizeof(int64_t));
    p->mark = calloc((size_t)n_expert, 1);
    p->front = calloc((size_t)n_expert, 1);
    if (!p->ranges || !p->mark || !p->front) {
        free(p->ranges);
        free(p->mark);
        free(p->front);
        free(p);
        return NULL;
    }
    memcpy(p->ranges, ranges, n * sizeof(int64_t));
    p->base = base;
    p->size = size;
    p->n_layer = n_layer;
    p->n_expert = n_expert;
    p->n_parts = n_parts;
    p->advise = 1;
    p->stage_part[0] = p->stage_part[1] = p->stage_part[2] = -1;
    p->kind_part[0] = p->kind_part[1] = p->kind_part[2] = -1;
    p->staged_layer = -1;
    long pg = sysconf(_SC_PAGESIZE);
    p->page = pg > 0 ? (size_t)pg : 4096;
    int64_t longest = 0;
    for (size_t i = 1; i < n; i += 2)
        if (ranges[i] > longest) longest = ranges[i];
    p->vec = malloc((size_t)longest / p->page + 2);
    if (!p->vec) {
        free(p->ranges);
        free(p->mark);
        free(p->front);
        free(p);
        return NULL;
    }
    return p;
}

void s2_prefetch_configure(s2_prefetch *p, int advise, int32_t *misses) {
    if (!p) return;
    p->advise = advise;
    p->misses = misses;
}

void s2_prefetch_set_ahead(s2_prefetch *p, const uint8_t *ahead) {
    if (p) p->ahead = ahead;
}

// The whole pages of part j (gate/up/down slice) of one expert: start offset and length in the mapping.
// Returns 0 for an empty or out-of-file range.
static int part_pages(const s2_prefetch *p, int layer, int e, int j, size_t *start, size_t *length) {
    const int64_t *r = p->ranges + (((size_t)layer * p->n_expert + e) * p->n_parts + j) * 2;
    const int64_t off = r[0], len = r[1];
    if (len <= 0 || off < 0 || (size_t)(off + len) > p->size) return 0;
    const size_t a = (size_t)off / p->page * p->page;
    const size_t b = ((size_t)(off + len) + p->page - 1) / p->page * p->page;
    *start = a;
    *length = (b > p->size ? p->size : b) - a;
    return 1;
}

// Whether every page of one expert of one layer is in the page cache. mincore on the expert's own
// ranges only: the cost follows the experts asked about, not the size of the model file.
// A part's first page is asked about first: under a budget most experts are out of memory, and the kernel's
// cost follows the pages asked about (a whole 1.7 MB expert took ~10 µs, its first page alone ~1 µs).
// Asked through llama.cpp's mapping where the expert cache knows it: a page its matmuls read stays mapped there,
// and mincore answers from the page table. Through ours, which reads nothing, the kernel looks each page up in
// the page cache: for a step whose experts are mostly in memory, a large share of the step (docs/offloading.md).
static uint8_t *cache_address(const s2_cache *c, size_t a, size_t n);

static int expert_resident(s2_prefetch *p, int layer, int e) {
    const s2_cache *c = p->cache;
    for (int j = 0; j < p->n_parts; ++j) {
        size_t a, n;
        if (!part_pages(p, layer, e, j, &a, &n)) continue;
        uint8_t *at = cache_address(c, a, n);
        if (!at) at = p->base + a;
        if (mincore(at, p->page, p->vec) != 0 || !(p->vec[0] & 1)) return 0;
        if (mincore(at, n, p->vec) != 0) return 0;
        for (size_t i = 0; i < (n + p->page - 1) / p->page; ++i)
            if (!(p->vec[i] & 1)) return 0;
    }
    return 1;
}

// The same for the routing hook (masked drafts ask about each candidate as its layer routes).
int s2_prefetch_expert_resident(void *p, int layer, int e) {
    s2_prefetch *q = p;
    if (!q || layer < 0 || layer >= q->n_layer || e < 0 || e >= q->n_expert) return 0;
    return expert_resident(q, layer, e);
}

// For each expert set in mask ([n_layer][n_expert], nonzero = ask), out = 1 if it is wholly resident.
// Returns how many of them are.
int s2_prefetch_resident(s2_prefetch *p, const uint8_t *mask, uint8_t *out) {
    if (!p || !mask || !out) return 0;
    int total = 0;
    for (int l = 0; l < p->n_layer; ++l)
        for (int e = 0; e < p->n_expert; ++e) {
            const size_t i = (size_t)l * p->n_expert + e;
            out[i] = mask[i] ? (uint8_t)expert_resident(p, l, e) : 0;
            total += out[i];
        }
    return total;
}

void s2_fetch_stop(s2_prefetch *p);

static void cache_free(s2_cache *c);
static void streamer_free(s2_prefetch *p);

void s2_prefetch_free(s2_prefetch *p) {
    if (!p) return;
    s2_fetch_stop(p);
    streamer_free(p);
    cache_free(p->cache);
    free(p->staged);
    free(p->pending);
    free(p->ranges);
    free(p->mark);
    free(p->front);
    free(p->vec);
    free(p);
}

// How a routed layer is read (stage_layer): whole, part by part, or whole but streamed (ask_part) while the
// matmuls' order is still being learned.
enum { READ_WHOLE, READ_BY_PART, READ_STREAMED };

static void cache_use(s2_prefetch *p, int layer);
static int stage_layer(s2_prefetch *p, int layer);
static void ask_part(s2_prefetch *p, int layer, int j);

static void advise_part(s2_prefetch *p, int layer, int e, int j) {
    size_t a, len;
    if (part_pages(p, layer, e, j, &a, &len) && madvise(p->base + a, len, MADV_WILLNEED) == 0)
        p->bytes_advised += (int64_t)len;
}

// The stage at which part j is used, once the matmuls' order is known; -1 before, or for a part no matmul reads.
static int part_stage(const s2_prefetch *p, int j) {
    for (int q = 0; q < 3; ++q)
        if (p->stage_part[q] == j) return q;
    return -1;
}

static void settle_predicted(s2_prefetch *p, int layer);

// madvise(WILLNEED) the ranges of the distinct experts among ids[0..n) of one layer (ids < 0 or out of
// range are ignored), first counting those not wholly in memory if misses are bound and, for a layer
// routing (used), making them the expert cache's most recent, its evictions done before the reads that
// need their room. Returns the number of distinct experts seen.
static int advise_layer(s2_prefetch *p, int layer, const int32_t *ids, int n, int count, int advise, int used) {
    if (!p || layer < 0 || layer >= p->n_layer || !ids || n <= 0) return 0;
    memset(p->mark, 0, (size_t)p->n_expert);
    const int cached = used && p->cache != NULL;
    if (cached) memset(p->front, 0, (size_t)p->n_expert);
    int advised = 0;
    for (int i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        if (cached && e >= 0 && e < p->n_expert && (p->lead <= 0 || i < p->lead)) p->front[e] = 1;
        if (e < 0 || e >= p->n_expert || p->mark[e]) continue;
        p->mark[e] = 1;
        ++advised;
        if ((count || cached) && !expert_resident(p, layer, e)) {
            p->mark[e] = 2;  // missed (the cache counts the ones it held that the kernel took anyway)
            if (count) p->misses[layer]++;
        }
    }
    if (used && p->pending) settle_predicted(p, layer);
    if (cached) cache_use(p, layer);
    const int staged = cached && advise ? stage_layer(p, layer) : READ_WHOLE;
    // Where the matmuls' order is known, every expert's part for the first matmul is asked for before any
    // expert's part for the second: a matmul runs its experts in id order, so it starts on the first while
    // the reads of the rest are still in flight (else, expert by expert). Parts of no matmul come first; a
    // staged layer's experts get their first matmul's part from ask_part, the others' once it ran.
    // An expert found wholly in memory (mark 1 where residency was looked at) is not asked for: WILLNEED would
    // look every page of its range up in the page cache all the same, for nothing.
    const int looked = count || cached;
    int stage_of[p->n_parts];
    for (int j = 0; j < p->n_parts; ++j) stage_of[j] = part_stage(p, j);
    if (staged != READ_WHOLE) ask_part(p, layer, staged == READ_BY_PART ? p->stage_part[0] : -1);
    for (int s = -1; advise && s < 3; ++s) {
        for (int e = 0; e < p->n_expert; ++e) {
            if (!p->mark[e] || (looked && p->mark[e] == 1)) continue;
            for (int j = 0; j < p->n_parts; ++j) {
                if (stage_of[j] != s || (staged != READ_WHOLE && p->staged[e] && (s >= 0 || staged == READ_STREAMED)))
                    continue;
                advise_part(p, layer, e, j);
            }
        }
    }
    p->n_calls++;
    p->n_advised += advised;
    return advised;
}

static int advise_predicted(s2_prefetch *p, int layer);
static void fetch_progress(s2_fetcher *f, int layer);

// The routing hook's callback: a layer's final ids, the moment before its expert matmuls read them.
int s2_prefetch_layer(s2_prefetch *p, int layer, const int32_t *ids, int n) {
    if (p && p->fetcher) fetch_progress(p->fetcher, layer);
    const int seen = advise_layer(p, layer, ids, n, p && p->misses != NULL, p && p->advise, 1);
    if (p && p->advise && p->ahead && layer + 1 < p->n_layer) advise_predicted(p, layer + 1);
    return seen;
}

// ---------------------------------------------------------------------------------------------------
// The expert cache, kept by this process instead of the kernel.
//
// Under a memory budget the page cache alone decides which experts stay, and it decides badly for this
// access pattern: an expert read twice lands on the kernel's active list and stays there long after its
// last use, while the inactive list, which holds what WILLNEED has just brought in, shrinks to a few MiB;
// reclaim then takes the pages the coming matmul asked for, and the matmul faults them back one page at a
// time (bursts of steps ten times slower, measured). Here every routed expert is stamped in a
// least-recently-used list over the budget plan's cache bytes (pinned hot experts aside), and the expert
// that falls off its end leaves memory at once: its pages are unmapped from llama.cpp's mapping
// (MADV_DONTNEED: the page cache keeps a shared file page, only the process's reference goes) and then
// dropped from the page cache (POSIX_FADV_DONTNEED drops only pages no process maps). MADV_PAGEOUT would
// do both in one call, but it skips the page cache's large folios that an expert's range cuts (measured:
// four in five experts stayed). The kernel then rarely has to choose, and the cache holds what the plan
// says.

struct s2_cache {
    uint8_t *base;          // llama.cpp's mapping, at the address file offset 0 would have
    size_t lo, hi;          // the file offsets that mapping covers
    int64_t capacity, used; // bytes
    int32_t *prev, *next;   // [n_layer * n_expert] the list, most recently used first; -1 ends it
    int32_t head, tail;
    uint8_t *held, *pinned; // [n_layer * n_expert]
    int64_t *bytes;         // [n_layer * n_expert] an expert's bytes (its parts' lengths)
    int32_t *share;         // [n_layer * n_expert * n_parts * 2] the expert whose bytes fill the rest of a
                            // part's first and last page, when that is one expert's part alone; -1 otherwise
    size_t span_lo, span_hi; // the file offsets from the first expert byte to the last, whole pages inside
    int fd;                 // the model file, for posix_fadvise
    int64_t n_evicted, n_refused, n_lost;  // n_refused: drops the kernel refused; n_lost: experts it held
                                           // that were not in memory when routed
    int64_t n_behind;       // experts entered at the least recent end (read by a verification's drafts only)
};

// Where llama.cpp's mapping has file range a..a+n; NULL without a cache, or where it does not cover the range.
static uint8_t *cache_address(const s2_cache *c, size_t a, size_t n) {
    return c && c->base && a >= c->lo && a + n <= c->hi ? c->base + a : NULL;
}

static void cache_unlink(s2_cache *c, int32_t i) {
    if (c->prev[i] >= 0) c->next[c->prev[i]] = c->next[i]; else c->head = c->next[i];
    if (c->next[i] >= 0) c->prev[c->next[i]] = c->prev[i]; else c->tail = c->prev[i];
    c->prev[i] = c->next[i] = -1;
}

static void cache_push_front(s2_cache *c, int32_t i) {
    c->prev[i] = -1;
    c->next[i] = c->head;
    if (c->head >= 0) c->prev[c->head] = i;
    c->head = i;
    if (c->tail < 0) c->tail = i;
}

static void cache_push_back(s2_cache *c, int32_t i) {
    c->next[i] = -1;
    c->prev[i] = c->tail;
    if (c->tail >= 0) c->next[c->tail] = i;
    c->tail = i;
    if (c->head < 0) c->head = i;
}

// A held expert whose pages left memory some other way (a layer read part by part drops each part once used).
static void cache_forget(s2_cache *c, int32_t i) {
    if (!c->held[i]) return;
    cache_unlink(c, i);
    c->held[i] = 0;
    c->used -= c->bytes[i];
}

// Whether a page an expert shares with expert `other` may leave memory with it: only when `other` is one
// the cache does not hold (nor pinned). An expert's parts rarely start on a page boundary, so almost every
// part shares its first and last page with the expert beside it in the tensor. Kept always, those pages
// (up to two a part) pile up beside the cache, counted nowhere, out of the budget's slack.
static int shared_page_goes(const s2_cache *c, int32_t other, const uint8_t *done, int layer, int n_expert) {
    if (other < 0 || c->pinned[other]) return 0;
    return !c->held[other] || (done && other / n_expert == layer && done[other % n_expert]);
}

// One part of an expert leaves memory: the pages wholly inside it, and each page it shares with an expert
// the cache does not hold (a page shared with a neighbouring tensor, or with a held expert, stays). done:
// experts of the same layer whose same part goes too (a staged layer's), so that their shared pages go.
static void drop_part(s2_prefetch *p, int32_t i, int j, const uint8_t *done) {
    s2_cache *c = p->cache;
    const size_t k = ((size_t)i * p->n_parts + j) * 2;
    const int64_t *r = p->ranges + k;
    if (r[1] <= 0 || (size_t)r[0] < c->lo || (size_t)(r[0] + r[1]) > c->hi) return;
    size_t a = ((size_t)r[0] + p->page - 1) / p->page * p->page;
    size_t b = (size_t)(r[0] + r[1]) / p->page * p->page;
    const int layer = i / p->n_expert;
    if (a != (size_t)r[0] && shared_page_goes(c, c->share[k], done, layer, p->n_expert)) a -= p->page;
    if (b != (size_t)(r[0] + r[1]) && shared_page_goes(c, c->share[k + 1], done, layer, p->n_expert)) b += p->page;
    if (b <= a) return;
    if (madvise(c->base + a, b - a, MADV_DONTNEED) != 0 ||
        posix_fadvise(c->fd, (off_t)a, (off_t)(b - a), POSIX_FADV_DONTNEED) != 0)
        ++c->n_refused;
}

// One expert leaves memory, all its parts.
static void drop_expert(s2_prefetch *p, int32_t i) {
    for (int j = 0; j < p->n_parts; ++j) drop_part(p, i, j, NULL);
}

static void cache_evict(s2_prefetch *p, int32_t i) {
    drop_expert(p, i);
    ++p->cache->n_evicted;
}

// What the cache holds beyond its capacity leaves memory, least recently used first, never the experts of
// `layer` that it just routed (p->mark; -1: no layer).
static void cache_trim(s2_prefetch *p, int layer) {
    s2_cache *c = p->cache;
    for (int32_t i = c->tail; i >= 0 && c->used > c->capacity;) {
        const int32_t newer = c->prev[i];
        if (i / p->n_expert != layer || !p->mark[i % p->n_expert]) {
            cache_unlink(c, i);
            c->held[i] = 0;
            c->used -= c->bytes[i];
            cache_evict(p, i);
        }
        i = newer;
    }
}

// The layer's distinct experts (p->mark) were just routed: they become the most recently used, and what
// the cache then holds beyond its capacity is paged out, least recently used first, never one of the
// layer's own (a layer that needs more than the whole cache keeps them until a later layer routes).
// In a verification only the first row's experts (p->front) count as used: the other rows are drafted
// tokens, rejected often, and a batch of them routes to more experts than the cache holds. Made the most
// recent, they would page out the experts the plain steps around the verification keep reading, and those
// steps would fetch them again. So an expert only they read enters at the least recent end, and one held
// already keeps its place.
static void cache_use(s2_prefetch *p, int layer) {
    s2_cache *c = p->cache;
    for (int e = 0; e < p->n_expert; ++e) {
        if (!p->mark[e]) continue;
        const int32_t i = layer * p->n_expert + e;
        if (c->pinned[i]) continue;
        if (c->held[i]) {
            if (p->mark[e] == 2) ++c->n_lost;
            if (!p->front[e]) continue;
            cache_unlink(c, i);
        } else {
            c->held[i] = 1;
            c->used += c->bytes[i];
            if (!p->front[e]) {
                cache_push_back(c, i);
                ++c->n_behind;
                continue;
            }
        }
        cache_push_front(c, i);
    }
    cache_trim(p, layer);
}

// Streaming. Where the staged experts' part alone outgrows stage_room (a prompt's prefill routes nearly every
// expert), WILLNEED on all of it at once has reclaim take the first experts before the matmul reaches them,
// and the matmul faults them back a page at a time. The kernel's sequential read-ahead does no better under
// a tight budget: it keeps two read-ahead windows in flight (read_ahead_kb, 8 MiB on some disks), reclaim
// takes one before the matmul reaches it, and the same window is read again and again (a prefill that never
// ended, measured). So a thread of ours streams the span: a matmul reads its experts in id order, each part
// one contiguous range, and the pages it has read are the ones this process maps (/proc/self/pagemap: under
// MADV_RANDOM a fault maps the page it needs and at most the fault-around pages next to it). The thread keeps
// `ahead` bytes asked for past the furthest page mapped, and drops the parts the matmul has left behind (as a
// stage's end would), so that what the stream holds stays within the room whatever else has grown.

typedef struct {
    size_t a, len;  // whole pages of one staged part, file offsets
    int32_t i;      // layer * n_expert + expert
    int j;          // the part
} stream_item;

struct s2_streamer {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int active, busy, quit;
    int pagemap;             // /proc/self/pagemap
    stream_item *items;      // the span's parts in the order the matmul reads them
    int n;
    int used;                // the furthest item the matmul has mapped pages of
    int dropped;             // items before this one are dropped
    int next;                // the next item to ask for, and how much of it is asked
    size_t next_done;
    int64_t ahead;
    int drop_behind;         // the matmul's order is known: what it left behind is not read again
    uint64_t *entries;       // pagemap scratch, one entry per page of the longest item
    int64_t n_dropped;       // items dropped behind the matmul
};

// The bytes of item k the matmul has mapped pages of, up to and including the furthest one (0: none). An
// item's first and last page may be shared with an expert beside it that is mapped already: they are not
// looked at (where the item has other pages).
static size_t item_read(const s2_prefetch *p, s2_streamer *s, int k) {
    const stream_item *it = &s->items[k];
    const size_t pages = it->len / p->page;
    const uintptr_t first = (uintptr_t)(p->cache->base + it->a) / p->page;
    const ssize_t got = pread(s->pagemap, s->entries, pages * sizeof(uint64_t), (off_t)(first * sizeof(uint64_t)));
    if (got <= 0) return 0;
    const size_t n = (size_t)got / sizeof(uint64_t), lo = n > 2 ? 1 : 0, hi = n > 2 ? n - 1 : n;
    for (size_t q = hi; q-- > lo;)
        if (s->entries[q] >> 63) return (q + 1) * p->page;
    return 0;
}

// One look at the matmul's progress: drop what it left behind, ask for what comes within `ahead` of it.
// Returns 0 once everything is asked for.
static int stream_step(s2_prefetch *p, s2_streamer *s) {
    size_t at = 0;  // the matmul's position: bytes of the span up to its furthest mapped page
    for (int k = s->next < s->n ? s->next : s->n - 1; k >= s->used; --k) {
        const size_t got = item_read(p, s, k);
        if (got) {
            s->used = k;
            at = got;
            break;
        }
    }
    // an expert's part may be read again for the next block of tokens: the one before the matmul's stays
    for (; s->drop_behind && s->dropped < s->used - 1; ++s->dropped) {
        drop_part(p, s->items[s->dropped].i, s->items[s->dropped].j, NULL);
        __atomic_fetch_add(&s->n_dropped, 1, __ATOMIC_RELAXED);
    }
    int64_t asked = (int64_t)s->next_done - (int64_t)at;  // asked for beyond the matmul
    for (int k = s->used; k < s->next && k < s->n; ++k) asked += (int64_t)s->items[k].len;
    while (s->next < s->n && asked < s->ahead) {
        const stream_item *it = &s->items[s->next];
        size_t len = it->len - s->next_done;
        if ((int64_t)len > s->ahead - asked) len = (size_t)(s->ahead - asked + p->page - 1) / p->page * p->page;
        if (len > it->len - s->next_done) len = it->len - s->next_done;
        if (madvise(p->base + it->a + s->next_done, len, MADV_WILLNEED) == 0)
            __atomic_fetch_add(&p->bytes_advised, (int64_t)len, __ATOMIC_RELAXED);
        asked += (int64_t)len;
        s->next_done += len;
        if (s->next_done >= it->len) {
            s->next++;
            s->next_done = 0;
        }
    }
    return s->next < s->n;
}

static void *stream_thread(void *arg) {
    s2_prefetch *p = arg;
    s2_streamer *s = p->streamer;
    pthread_mutex_lock(&s->mu);
    while (!s->quit) {
        if (!s->active) {
            pthread_cond_wait(&s->cv, &s->mu);
            continue;
        }
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        const int more = stream_step(p, s);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        if (!more) s->active = 0;
        pthread_cond_broadcast(&s->cv);
        if (s->active && !s->quit) {
            // a read of `ahead` takes milliseconds; a look every half of one keeps the disk busy
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_nsec += 500000;
            if (t.tv_nsec >= 1000000000) {
                t.tv_sec++;
                t.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&s->cv, &s->mu, &t);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static s2_streamer *streamer_start(s2_prefetch *p) {
    s2_streamer *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    int64_t longest = 0;
    for (size_t k = 1; k < (size_t)p->n_layer * p->n_expert * p->n_parts * 2; k += 2)
        if (p->ranges[k] > longest) longest = p->ranges[k];
    s->items = malloc((size_t)p->n_expert * p->n_parts * sizeof *s->items);
    s->entries = malloc(((size_t)longest / p->page + 2) * sizeof(uint64_t));
    s->pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (!s->items || !s->entries || s->pagemap < 0) goto fail;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    p->streamer = s;
    if (pthread_create(&s->thread, NULL, stream_thread, p) == 0) return s;
    p->streamer = NULL;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
fail:
    if (s->pagemap >= 0) close(s->pagemap);
    free(s->items);
    free(s->entries);
    free(s);
    return NULL;
}

// The stream stops (the matmul it fed has run, or the layer ends): the thread is idle when this returns.
static void end_stream(s2_prefetch *p) {
    s2_streamer *s = p->streamer;
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->active = 0;
    while (s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static void streamer_free(s2_prefetch *p) {
    s2_streamer *s = p->streamer;
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->quit = 1;
    s->active = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    close(s->pagemap);
    free(s->items);
    free(s->entries);
    free(s);
    p->streamer = NULL;
}

// Part j (-1: every part) of the staged experts of a layer: asked for at once where it fits stage_room,
// else streamed (above), a quarter of the room kept asked for ahead of the matmul.
static void ask_part(s2_prefetch *p, int layer, int j) {
    const int j0 = j < 0 ? 0 : j, j1 = j < 0 ? p->n_parts : j + 1;
    s2_cache *c = p->cache;
    int64_t bytes = 0;
    int inside = c != NULL;
    for (int k = j0; k < j1; ++k)
        for (int e = 0; e < p->n_expert; ++e) {
            size_t a, len;
            if (!p->staged[e] || !part_pages(p, layer, e, k, &a, &len)) continue;
            bytes += (int64_t)len;
            inside = inside && a >= c->lo && a + len <= c->hi;
        }
    const int streams = p->stream && inside && bytes > p->stage_room;
    s2_streamer *s = streams && !p->streamer ? streamer_start(p) : p->streamer;
    if (!streams || !s) {
        for (int k = j0; k < j1; ++k)
            for (int e = 0; e < p->n_expert; ++e)
                if (p->staged[e]) advise_part(p, layer, e, k);
        return;
    }
    // the thread is idle (end_stream came first): its items are ours to fill. Pages of them still mapped (an
    // expert the kernel reclaimed in part) are unmapped, so that a mapped page says the matmul has been there.
    s->n = 0;
    for (int k = j0; k < j1; ++k)
        for (int e = 0; e < p->n_expert; ++e) {
            size_t a, len;
            if (!p->staged[e] || !part_pages(p, layer, e, k, &a, &len)) continue;
            s->items[s->n++] = (stream_item){a, len, (int32_t)(layer * p->n_expert + e), k};
            madvise(c->base + a, len, MADV_DONTNEED);
        }
    s->drop_behind = j >= 0;
    s->used = s->dropped = s->next = 0;
    s->next_done = 0;
    s->ahead = p->stage_room / 4 > (int64_t)p->page ? p->stage_room / 4 : (int64_t)p->page;
    p->n_streamed++;
    stream_step(p, s);  // the first reads start before the matmul does
    pthread_mutex_lock(&s->mu);
    s->active = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

// Staged reads. The layer just routed (p->mark: 2 = not in memory) is read part by part when what it must
// fetch exceeds stage_room: asked for all at once, a reclaim that has to make room takes pages WILLNEED
// brought in and no matmul has mapped yet, and the matmuls fault them back a page at a time.
// kind_part: the part indices of the up, gate and down matrices (the order their matmuls run in is
// llama.cpp's graph's: it is learned from the stage callbacks of the first layer that runs). A room below
// zero: the order is learned and parts are asked for in it (advise_layer), but no layer is read in stages.
void s2_prefetch_set_stages(s2_prefetch *p, const int32_t *kind_part, int64_t room, int stream) {
    if (!p) return;
    end_stream(p);
    p->stream = stream;
    int ok = kind_part != NULL;
    for (int k = 0; ok && k < 3; ++k) ok = kind_part[k] >= 0 && kind_part[k] < p->n_parts;
    if (ok && !p->staged) p->staged = calloc((size_t)p->n_expert, 1);
    ok = ok && p->staged;
    for (int k = 0; k < 3; ++k) {
        p->kind_part[k] = ok ? kind_part[k] : -1;
        p->stage_part[k] = -1;
    }
    p->n_order = 0;
    p->learn_layer = -1;
    p->stage_room = room;
    p->staged_layer = -1;
}

// The kinds of stage callbacks in the order they came for one layer; staging starts once all three came.
static void learn_order(s2_prefetch *p, int layer, int kind) {
    if (p->learn_layer < 0) p->learn_layer = layer;
    if (layer != p->learn_layer) return;
    for (int q = 0; q < p->n_order; ++q)
        if (p->order[q] == kind) return;
    p->order[p->n_order++] = kind;
    if (p->n_order < 3) return;
    for (int q = 0; q < 3; ++q) {
        p->stage_part[q] = p->kind_part[p->order[q]];
        p->kind_stage[p->order[q]] = q;
    }
}

// The order learned: the kinds (0 up, 1 gate, 2 down) as a layer's matmuls run them. Returns how many.
int s2_prefetch_stage_order(const s2_prefetch *p, int32_t *out) {
    if (!p) return 0;
    for (int q = 0; q < p->n_order; ++q) out[q] = p->order[q];
    return p->n_order;
}

// A layer routing ends the staging of one whose last matmul never came (a decode stopped midway): its stage
// calls would otherwise drop the parts of experts this layer reads.
// Returns how the layer is read: READ_STREAMED where it must be read part by part but the matmuls' order is
// still being learned (from this layer's stage calls).
static int stage_layer(s2_prefetch *p, int layer) {
    end_stream(p);
    p->staged_layer = -1;
    if (p->kind_part[0] < 0 || p->stage_room < 0) return READ_WHOLE;
    int64_t fetch = 0;
    for (int e = 0; e < p->n_expert; ++e) {
        const size_t i = (size_t)layer * p->n_expert + e;
        p->staged[e] = p->mark[e] == 2 && !p->cache->pinned[i];
        if (p->staged[e]) fetch += p->cache->bytes[i];
    }
    if (fetch <= p->stage_room) return READ_WHOLE;
    if (p->stage_part[0] < 0) return READ_STREAMED;
    p->staged_layer = layer;
    p->n_staged++;
    return READ_BY_PART;
}

// The routing hook's stage callback: the layer's matmul of one kind (0 up, 1 gate, 2 down) has run. With ask,
// only whether that call is wanted (while the order is learned, or for the layer being read in stages): the
// graph stops at each wanted call, and a layer read whole needs none.
int s2_prefetch_stage(s2_prefetch *p, int layer, int kind, int ask) {
    if (!p || kind < 0 || kind > 2 || p->kind_part[0] < 0) return 0;
    if (ask) return p->n_order < 3 || layer == p->staged_layer;
    if (p->n_order < 3) learn_order(p, layer, kind);
    if (layer != p->staged_layer) return 0;
    const int q = p->kind_stage[kind];
    end_stream(p);  // before the drops: the thread drops parts of the same experts
    int n = 0;
    for (int e = 0; e < p->n_expert; ++e) {
        if (!p->staged[e]) continue;
        const int32_t i = layer * p->n_expert + e;
        drop_part(p, i, p->stage_part[q], p->staged);
        if (q == 2) cache_forget(p->cache, i);
        ++n;
    }
    if (q < 2) ask_part(p, layer, p->stage_part[q + 1]);
    else p->staged_layer = -1;
    return n;
}

// Unmaps the span of expert bytes that a mapping (at `base` for file offset 0, covering lo..hi) maps, and
// drops from the page cache what no mapping maps any more.
static void drop_expert_span(const s2_cache *c, uint8_t *base, size_t lo, size_t hi) {
    const size_t first = c->span_lo > lo ? c->span_lo : lo, last = c->span_hi < hi ? c->span_hi : hi;
    if (last > first) {
        madvise(base + first, last - first, MADV_DONTNEED);
        posix_fadvise(c->fd, (off_t)first, (off_t)(last - first), POSIX_FADV_DONTNEED);
    }
}

static void cache_free(s2_cache *c) {
    if (!c) return;
    if (c->fd >= 0) close(c->fd);
    free(c->prev);
    free(c->next);
    free(c->held);
    free(c->pinned);
    free(c->bytes);
    free(c->share);
    free(c);
}

// For each part of each expert, the expert that fills the rest of the part's first page (share[2k]) and of
// its last page (share[2k + 1]): the part that ends where this one starts, or starts where it ends, when
// that part alone covers the rest of the page; -1 where the page also holds other bytes (another tensor,
// padding) or the part starts or ends on a page boundary. Parts are matched in file order.
typedef struct { int64_t offset; int32_t part; } part_at;

static int cmp_part(const void *x, const void *y) {
    const int64_t a = ((const part_at *)x)->offset, b = ((const part_at *)y)->offset;
    return (a > b) - (a < b);
}

static int find_shared_pages(const s2_prefetch *p, int32_t *share) {
    const size_t n = (size_t)p->n_layer * p->n_expert * p->n_parts;
    part_at *order = malloc(n * sizeof *order);
    if (!order) return -1;
    size_t m = 0;
    for (size_t k = 0; k < n; ++k) {
        share[2 * k] = share[2 * k + 1] = -1;
        if (p->ranges[2 * k + 1] > 0) order[m++] = (part_at){p->ranges[2 * k], (int32_t)k};
    }
    qsort(order, m, sizeof *order, cmp_part);
    for (size_t q = 1; q < m; ++q) {
        const size_t before = (size_t)order[q - 1].part, after = (size_t)order[q].part;
        const size_t first = (size_t)p->ranges[2 * before], start = (size_t)p->ranges[2 * after];
        const size_t end = first + (size_t)p->ranges[2 * before + 1], last = start + (size_t)p->ranges[2 * after + 1];
        const size_t page = start / p->page * p->page;
        if (end != start || start == page || first > page || last < page + p->page) continue;
        share[2 * after] = (int32_t)(before / p->n_parts);
        share[2 * before + 1] = (int32_t)(after / p->n_parts);
    }
    free(order);
    return 0;
}

// Keep the expert cache here: path the model file, llama_base llama.cpp's mapping of it from offset lo
// to hi (its address for offset 0 is llama_base - lo), capacity the bytes of unpinned experts to hold,
// pinned ([n_layer][n_expert], nonzero = pinned, never cached or evicted). capacity < 0 hands the cache
// back to the kernel. Returns 0, or -1 when the file cannot be opened or memory is short.
int s2_cache_keep(s2_prefetch *p, const char *path, void *llama_base, size_t lo, size_t hi, int64_t capacity,
                  const uint8_t *pinned) {
    if (!p) return -1;
    cache_free(p->cache);
    p->cache = NULL;
    if (capacity < 0 || !llama_base || hi <= lo) return 0;
    const size_t n = (size_t)p->n_layer * p->n_expert;
    s2_cache *c = calloc(1, sizeof *c);
    if (!c) return -1;
    c->fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (c->fd < 0) {
        free(c);
        return -1;
    }
    c->prev = malloc(n * sizeof(int32_t));
    c->next = malloc(n * sizeof(int32_t));
    c->held = calloc(n, 1);
    c->pinned = calloc(n, 1);
    c->bytes = calloc(n, sizeof(int64_t));
    c->share = malloc(n * p->n_parts * 2 * sizeof(int32_t));
    if (!c->prev || !c->next || !c->held || !c->pinned || !c->bytes || !c->share ||
        find_shared_pages(p, c->share) != 0) {
        cache_free(c);
        return -1;
    }
    size_t first = SIZE_MAX, last = 0;
    for (size_t i = 0; i < n; ++i) {
        c->prev[i] = c->next[i] = -1;
        if (pinned) c->pinned[i] = pinned[i] != 0;
        for (int j = 0; j < p->n_parts; ++j) {
            const int64_t off = p->ranges[(i * p->n_parts + j) * 2], len = p->ranges[(i * p->n_parts + j) * 2 + 1];
            if (len <= 0) continue;
            c->bytes[i] += len;
            if ((size_t)off < first) first = (size_t)off;
            if ((size_t)(off + len) > last) last = (size_t)(off + len);
        }
    }
    c->span_lo = (first + p->page - 1) / p->page * p->page;
    c->span_hi = last / p->page * p->page;
    c->head = c->tail = -1;
    c->base = (uint8_t *)llama_base - lo;
    c->lo = lo;
    c->hi = hi;
    c->capacity = capacity;
    p->cache = c;
    // It starts empty: what is in memory now (a warm-up's reads) would otherwise stay beside it, uncounted,
    // until the kernel's reclaim takes the cache's own experts to make room. Dropped as one span, not
    // expert by expert: the page cache drops only whole folios, and a read-around of the warm-up leaves
    // folios of up to MiBs across expert boundaries (one expert at a time left 15% of them, measured).
    // Reads from here on (WILLNEED, faults without read-around) come in single pages. Pinned experts stay:
    // their pages are mapped (mlock), and the page cache never drops a mapped page.
    drop_expert_span(c, c->base, lo, hi);
    return 0;
}

// The process grew past what the budget's plan counted (a Python heap that fragments, a longer context's
// buffers): the cache gives way, as the budget holds the rest. Its least recent experts leave memory until it
// holds `capacity` bytes, and layers are read in stages past `stage_room` (where they are staged at all).
void s2_cache_resize(s2_prefetch *p, int64_t capacity, int64_t stage_room) {
    s2_cache *c = p ? p->cache : NULL;
    if (!c || capacity < 0) return;
    end_stream(p);
    c->capacity = capacity;
    cache_trim(p, -1);
    if (p->stage_room >= 0 && stage_room >= 0) p->stage_room = stage_room;
}

// A pinned expert gives way (pinned 0: the process grew past what the cache could give up; the caller unlocked
// and unmapped it in its own mapping first), its pages leaving memory as an eviction's would; or it is pinned
// again (pinned 1: the caller reads and locks it next), no longer counted by the cache if it held it.
void s2_cache_pin(s2_prefetch *p, int layer, int e, int pinned) {
    s2_cache *c = p ? p->cache : NULL;
    if (!c || layer < 0 || layer >= p->n_layer || e < 0 || e >= p->n_expert) return;
    const int32_t i = layer * p->n_expert + e;
    end_stream(p);
    if (pinned) {
        cache_forget(c, i);
        c->pinned[i] = 1;
    } else if (c->pinned[i]) {
        c->pinned[i] = 0;
        drop_expert(p, i);
    }
}

// A draft that ran on another mapping of the model file (a drafter that loaded the weights a second time,
// without the routing hook) read experts this cache never saw routed, and that mapping keeps them in memory
// beside the cache, uncounted, until the kernel's reclaim takes the cache's own. They are unmapped there and
// dropped. The cache's experts stay: llama.cpp's own mapping maps them (pinned ones are locked in ours).
void s2_cache_drop_mapping(s2_prefetch *p, void *base, size_t lo, size_t hi) {
    if (!p || !p->cache || !base || hi <= lo) return;
    drop_expert_span(p->cache, (uint8_t *)base - lo, lo, hi);
}

// out: bytes held, experts evicted, evictions the kernel refused part of, experts held that the kernel
// had reclaimed all the same, layers read part by part, spans streamed, experts entered at the least recent
// end, streamed parts dropped behind the matmul (0 each without a cache)
void s2_cache_stats(const s2_prefetch *p, int64_t *out) {
    const s2_cache *c = p ? p->cache : NULL;
    out[0] = c ? c->used : 0;
    out[1] = c ? c->n_evicted : 0;
    out[2] = c ? c->n_refused : 0;
    out[3] = c ? c->n_lost : 0;
    out[4] = c ? p->n_staged : 0;
    out[5] = c ? p->n_streamed : 0;
    out[6] = c ? c->n_behind : 0;
    out[7] = c && p->streamer ? __atomic_load_n(&p->streamer->n_dropped, __ATOMIC_RELAXED) : 0;
}

// Of the ids a routed layer hands over next, the first `lead` are the row whose output is kept whatever
// the verification decides (cache_use); lead <= 0: every one is.
void s2_cache_lead(s2_prefetch *p, int lead) {
    if (p) p->lead = lead;
}

// An expert's bytes as read: its parts' whole pages.
static int64_t expert_pages(const s2_prefetch *p, int layer, int e) {
    int64_t total = 0;
    for (int j = 0; j < p->n_parts; ++j) {
        size_t a, n;
        if (part_pages(p, layer, e, j, &a, &n)) total += (int64_t)n;
    }
    return total;
}

// The routing hook's pre-gating callback: a later layer's router, applied to the hidden state of a layer routing
// now, predicts that layer's experts. Those not in memory are asked for now (WILLNEED: the kernel's reads run at
// queue depth while the layers before theirs compute) and remembered until their layer routes (settle_predicted).
// Held by the kept cache or pinned counts as in memory (a mincore per expert would cost more than the rare expert
// the kernel took from the cache). Returns the experts asked for.
int s2_prefetch_predicted(void *vp, int layer, const int32_t *ids, int n) {
    s2_prefetch *p = vp;
    if (!p || !p->advise || layer < 0 || layer >= p->n_layer || !ids) return 0;
    if (!p->pending && !(p->pending = calloc((size_t)p->n_layer * p->n_expert, 1))) return 0;
    int asked = 0;
    for (int q = 0; q < n; ++q) {
        const int32_t e = ids[q];
        if (e < 0 || e >= p->n_expert) continue;
        const size_t i = (size_t)layer * p->n_expert + e;
        if (p->pending[i]) continue;
        if (p->cache ? p->cache->held[i] || p->cache->pinned[i] : expert_resident(p, layer, e)) continue;
        for (int j = 0; j < p->n_parts; ++j) advise_part(p, layer, e, j);
        p->pending[i] = 1;
        p->pg_read++;
        p->pg_read_bytes += expert_pages(p, layer, e);
        ++asked;
    }
    return asked;
}

// The layer routed (p->mark: its experts): what pre-gating read for it was used or was read for nothing. A wrong
// guess enters the kept cache at its least recent end, counted there like any expert in memory: the cache's trim
// that follows pages it out first, unless the cache has room to spare.
static void settle_predicted(s2_prefetch *p, int layer) {
    s2_cache *c = p->cache;
    for (int e = 0; e < p->n_expert; ++e) {
        const size_t i = (size_t)layer * p->n_expert + e;
        if (!p->pending[i]) continue;
        p->pending[i] = 0;
        const int64_t bytes = expert_pages(p, layer, e);
        if (p->mark[e]) {
            p->pg_used++;
            p->pg_used_bytes += bytes;
            continue;
        }
        p->pg_wasted++;
        p->pg_wasted_bytes += bytes;
        if (c && !c->held[i] && !c->pinned[i]) {
            c->held[i] = 1;
            c->used += c->bytes[i];
            cache_push_back(c, (int32_t)i);
        }
    }
}

// out: experts pre-gating read and their bytes, of those the ones their layer then used, and the ones it did not
// (read for nothing), with their bytes.
void s2_prefetch_pregate_stats(const s2_prefetch *p, int64_t *out) {
    out[0] = p ? p->pg_read : 0;
    out[1] = p ? p->pg_read_bytes : 0;
    out[2] = p ? p->pg_used : 0;
    out[3] = p ? p->pg_used_bytes : 0;
    out[4] = p ? p->pg_wasted : 0;
    out[5] = p ? p->pg_wasted_bytes : 0;
}

// WILLNEED the predicted experts of one layer that are not wholly resident yet.
static int advise_predicted(s2_prefetch *p, int layer) {
    int asked = 0;
    for (int e = 0; e < p->n_expert; ++e) {
        if (!p->ahead[(size_t)layer * p->n_expert + e] || expert_resident(p, layer, e)) continue;
        for (int j = 0; j < p->n_parts; ++j) {
            size_t a, n;
            if (part_pages(p, layer, e, j, &a, &n) && madvise(p->base + a, n, MADV_WILLNEED) == 0)
                p->bytes_advised += (int64_t)n;
        }
        ++asked;
    }
    return asked;
}

// The same for a [n_layer][n_expert] mask (nonzero = advise), e.g. a draft's predicted experts.
int s2_prefetch_mask(s2_prefetch *p, const uint8_t *mask) {
    if (!p || !mask) return 0;
    int total = 0;
    int32_t *ids = malloc((size_t)p->n_expert * sizeof(int32_t));
    if (!ids) return 0;
    for (int l = 0; l < p->n_layer; ++l) {
        int n = 0;
        for (int e = 0; e < p->n_expert; ++e)
            if (mask[(size_t)l * p->n_expert + e]) ids[n++] = e;
        if (n) total += advise_layer(p, l, ids, n, 0, 1, 0);
    }
    free(ids);
    return total;
}

int64_t s2_prefetch_bytes(const s2_prefetch *p) { return p ? p->bytes_advised : 0; }
int64_t s2_prefetch_calls(const s2_prefetch *p) { return p ? p->n_calls : 0; }

// ---------------------------------------------------------------------------------------------------
// Fetching a verification's experts at the storage's speed.
//
// A page fault reads one page (or one read-around window) and the decoding thread waits for it: one read
// in flight at a time. But a verification's experts are known before it runs: each draft pass's router
// names the experts the target will route its token to. Worker threads read those experts with pread
// (the page cache keeps what they read, which is all that matters here), several at a time, in layer
// order, while the draft passes still compute and then ahead of the verification's own progress.
//
// What they may read is bounded by `room` bytes: the experts read and not yet used (their layer not yet
// reached by the verification) must fit the expert cache, or they evict each other before use. The
// verification's progress comes from the routing hook: when layer L routes, the experts of layers below
// L have been read by their matmuls. A worker skips an expert already wholly in memory.
//
// Our file descriptor is POSIX_FADV_RANDOM: a read then brings in exactly the pages asked for, not a
// read-ahead window beyond the expert.

enum { WANT_NONE = 0, WANT_QUEUED = 1, WANT_TAKEN = 2 };

struct s2_fetcher {
    s2_prefetch *p;
    int fd, n_workers;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint8_t *state;       // [n_layer][n_expert] WANT_*
    int64_t *bytes;       // [n_layer][n_expert] an expert's bytes (sum of its parts' page spans)
    int64_t room;         // bytes that may be read ahead of the verification
    int32_t *taken_at;    // [n_layer][n_expert] layers the verification had routed when a worker took the
                          // expert (-1: before it started; -2: not taken since queued)
    int verifying;        // the verification runs: progress follows its layers
    int layer;            // experts of layers below this one have been used
    int routed;           // layers the verification has routed so far
    int stop;
    int64_t n_read, n_resident, n_late, bytes_read;
    double read_seconds;  // summed over workers
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

// The next expert a worker may read (index into state), or -1. Called with the lock held.
static int next_wanted(s2_fetcher *f) {
    const s2_prefetch *p = f->p;
    int64_t ahead = 0;  // taken and not yet used
    for (int l = f->layer; l < p->n_layer; ++l)
        for (int e = 0; e < p->n_expert; ++e) {
            const size_t i = (size_t)l * p->n_expert + e;
            if (f->state[i] == WANT_TAKEN) ahead += f->bytes[i];
        }
    for (int l = f->layer; l < p->n_layer; ++l)
        for (int e = 0; e < p->n_expert; ++e) {
            const size_t i = (size_t)l * p->n_expert + e;
            if (f->state[i] != WANT_QUEUED) continue;
            return ahead + f->bytes[i] <= f->room ? (int)i : -1;
        }
    return -1;
}

static void *fetch_worker(void *arg) {
    s2_fetcher *f = arg;
    s2_prefetch *p = f->p;
    int64_t longest = 0;
    for (size_t i = 1; i < (size_t)p->n_layer * p->n_expert * p->n_parts * 2; i += 2)
        if (p->ranges[i] > longest) longest = p->ranges[i];
    char *buf = malloc((size_t)longest + 2 * p->page);
    unsigned char *vec = malloc((size_t)longest / p->page + 2);
    pthread_mutex_lock(&f->mu);
    while (buf && vec && !f->stop) {
        const int i = next_wanted(f);
        if (i < 0) {
            pthread_cond_wait(&f->cv, &f->mu);
            continue;
        }
        f->state[i] = WANT_TAKEN;
        f->taken_at[i] = f->verifying ? f->routed : -1;
        pthread_mutex_unlock(&f->mu);

        const int layer = i / p->n_expert, e = i % p->n_expert;
        const double t0 = now_s();
        int resident = 1;
        int64_t got = 0;
        for (int j = 0; j < p->n_parts; ++j) {
            size_t a, n;
            if (!part_pages(p, layer, e, j, &a, &n)) continue;
            int here = mincore(p->base + a, n, vec) == 0;
            for (size_t q = 0; here && q < (n + p->page - 1) / p->page; ++q) here = vec[q] & 1;
            if (here) continue;
            resident = 0;
            for (size_t off = 0; off < n;) {
                const ssize_t r = pread(f->fd, buf, n - off, (off_t)(a + off));
                if (r <= 0) break;
                off += (size_t)r;
                got += r;
            }
        }
        const double dt = now_s() - t0;

        pthread_mutex_lock(&f->mu);
        if (resident) f->n_resident++;
        else {
            f->n_read++;
            f->bytes_read += got;
            f->read_seconds += dt;
        }
    }
    pthread_mutex_unlock(&f->mu);
    free(buf);
    free(vec);
    return NULL;
}

// Start n_workers reader threads on the model file at path (the file p maps). Returns 0, or -1.
int s2_fetch_start(s2_prefetch *p, const char *path, int n_workers, int64_t room) {
    if (!p || p->fetcher || !path || n_workers <= 0) return -1;
    s2_fetcher *f = calloc(1, sizeof *f);
    if (!f) return -1;
    const size_t n = (size_t)p->n_layer * p->n_expert;
    f->p = p;
    f->room = room;
    f->state = calloc(n, 1);
    f->bytes = calloc(n, sizeof(int64_t));
    f->taken_at = malloc(n * sizeof(int32_t));
    f->threads = calloc((size_t)n_workers, sizeof(pthread_t));
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (!f->state || !f->bytes || !f->taken_at || !f->threads || f->fd < 0) goto fail;
    for (size_t i = 0; i < n; ++i) f->taken_at[i] = -2;
    posix_fadvise(f->fd, 0, 0, POSIX_FADV_RANDOM);
    for (size_t i = 0; i < n; ++i)
        for (int j = 0; j < p->n_parts; ++j) {
            size_t a, len;
            if (part_pages(p, (int)(i / p->n_expert), (int)(i % p->n_expert), j, &a, &len)) f->bytes[i] += (int64_t)len;
        }
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    for (int w = 0; w < n_workers; ++w) {
        if (pthread_create(&f->threads[w], NULL, fetch_worker, f) != 0) break;
        f->n_workers++;
    }
    if (f->n_workers == 0) {
        pthread_mutex_destroy(&f->mu);
        pthread_cond_destroy(&f->cv);
        goto fail;
    }
    p->fetcher = f;
    return 0;
fail:
    if (f->fd >= 0) close(f->fd);
    free(f->state);
    free(f->bytes);
    free(f->taken_at);
    free(f->threads);
    free(f);
    return -1;
}

void s2_fetch_stop(s2_prefetch *p) {
    s2_fetcher *f = p ? p->fetcher : NULL;
    if (!f) return;
    pthread_mutex_lock(&f->mu);
    f->stop = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    for (int w = 0; w < f->n_workers; ++w) pthread_join(f->threads[w], NULL);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    close(f->fd);
    free(f->state);
    free(f->bytes);
    free(f->taken_at);
    free(f->threads);
    free(f);
    p->fetcher = NULL;
}

// The experts set in mask ([n_layer][n_expert]) are predicted for the coming verification: queue those
// not queued yet. The first call after a verification starts a new proposal (forgets the last one's).
void s2_fetch_want(s2_prefetch *p, const uint8_t *mask) {
    s2_fetcher *f = p ? p->fetcher : NULL;
    if (!f || !mask) return;
    const size_t n = (size_t)p->n_layer * p->n_expert;
    pthread_mutex_lock(&f->mu);
    if (f->verifying) {
        for (size_t i = 0; i < n; ++i) {
            // an expert still queued when its layer had passed was never read ahead
            if (f->state[i] == WANT_QUEUED) f->n_late++;
            f->state[i] = WANT_NONE;
        }
        f->verifying = 0;
        f->layer = 0;
    }
    for (size_t i = 0; i < n; ++i)
        if (mask[i] && f->state[i] == WANT_NONE) {
            f->state[i] = WANT_QUEUED;
            f->taken_at[i] = -2;
        }
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

// The verification starts: from now on the routing hook's layers say which experts have been used.
void s2_fetch_verify(s2_prefetch *p) {
    s2_fetcher *f = p ? p->fetcher : NULL;
    if (!f) return;
    pthread_mutex_lock(&f->mu);
    f->verifying = 1;
    f->layer = 0;
    f->routed = 0;
    pthread_mutex_unlock(&f->mu);
}

static void fetch_progress(s2_fetcher *f, int layer) {
    pthread_mutex_lock(&f->mu);
    f->routed += f->verifying;
    if (f->verifying && layer > f->layer) {
        f->layer = layer;
        pthread_cond_broadcast(&f->cv);  // room freed: the experts of the layers passed are used
    }
    pthread_mutex_unlock(&f->mu);
}

// For each expert ([n_layer][n_expert] into out), how many layers the verification had routed when a worker
// took it (-1: before the verification started; -2: not taken since it was queued): the order reads and the
// verification's progress came in, whatever the timing.
void s2_fetch_taken_at(s2_prefetch *p, int32_t *out) {
    s2_fetcher *f = p ? p->fetcher : NULL;
    if (!f || !out) return;
    pthread_mutex_lock(&f->mu);
    memcpy(out, f->taken_at, (size_t)p->n_layer * p->n_expert * sizeof(int32_t));
    pthread_mutex_unlock(&f->mu);
}

// Counters: experts read, experts found already in memory, experts still queued when their layer passed,
// bytes read, seconds the workers spent reading (summed).
void s2_fetch_stats(s2_prefetch *p, int64_t *out, double *seconds) {
    s2_fetcher *f = p ? p->fetcher : NULL;
    if (!f) return;
    pthread_mutex_lock(&f->mu);
    out[0] = f->n_read;
    out[1] = f->n_resident;
    out[2] = f->n_late;
    out[3] = f->bytes_read;
    *seconds = f->read_seconds;
    pthread_mutex_unlock(&f->mu);
}
