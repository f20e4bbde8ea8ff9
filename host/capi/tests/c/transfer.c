/*
 * A prefill or a decode engine rank written in C against kvferry.h alone: the proof that the C
 * API moves a KV cache between two processes byte for byte.
 *
 *   transfer prefill ENDPOINT_FILE PLUGIN_DIR [TRANSPORT]
 *   transfer decode  ENDPOINT_FILE PLUGIN_DIR [TRANSPORT]
 *
 * Each side allocates its own pool (aligned_alloc) and describes it in the JSON configuration:
 * a small GQA model, 2 layers of 2 KV heads x 32 bf16 elements, K and V, 16 tokens per block,
 * one PAGED layer group, one pool, one HND view {key, value}, tp1. The two sides lay a slot out
 * differently: the prefill packs layers 0, 1 back to back in 16 slots; the decode stores them
 * last first with a 128-byte gap, pads every slot by 256 bytes, and has 12 slots. The planner
 * (kvferry.default, loaded from PLUGIN_DIR) maps one onto the other.
 *
 * Every 64-byte row (one head of one token of one layer's K or V) is a function of the model
 * coordinates (request, layer, K/V, head, token) alone. The prefill fills the rows of its
 * request slots and sends three requests (one in two chunks); the decode fills its whole pool
 * with a canary, writes a cached prefix of its own into one request's first block, adds the
 * prefill's metadata (ENDPOINT_FILE.meta, from kvferry_agent_local_metadata) with
 * kvferry_agent_add_peer, expects all three (two also naming the endpoint the prefill wrote to
 * ENDPOINT_FILE, one with no endpoint at all), waits on the wake descriptor
 * with poll(2), and then checks every byte of its pool: each received row holds the prefill's
 * pattern, each cached row its own, and every other byte (padding, gaps, other slots, rows
 * past the prompt) its canary — except that rows past the prompt in a request's last block
 * may hold the pattern too, whole rows only. It prints one line starting "decode: verified"
 * and exits 0, or names the first wrong byte and exits 1. The prefill prints "prefill: sent".
 *
 * The secret comes from KVFERRY_TEST_SECRET (a fixed test value without it).
 */

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvferry.h"

#define LAYERS 2u
#define HEADS 2u
#define HEAD_DIM 32u
#define ELEM_BYTES 2u
#define TPB 16u
#define ROW (HEAD_DIM * ELEM_BYTES)  /* bytes of one head of one token */
#define BUFFER (HEADS * TPB * ROW)   /* one layer's K (or V) of one block: [head][token][dim] */
#define REGION (2u * BUFFER)         /* one layer: K then V */
#define CANARY 0xA5
#define FOREIGN 0x5A
#define N_REQUESTS 3
#define MAX_BLOCKS 4

static const uint64_t SALT_PREFILL = 0x50524546494c4c00ull;
static const uint64_t SALT_CACHED = 0x4341434845440000ull;

/* How one side lays out its pool. */
struct side {
  const char *name;
  const char *role;
  unsigned slots;
  unsigned layer_gap;
  unsigned slot_padding;
  int reversed;
  size_t slot_bytes, stride, footprint;
  size_t layer_offset[LAYERS];
  uint8_t *pool;
};

static void side_init(struct side *s) {
  for (unsigned l = 0; l < LAYERS; l++) {
    unsigned position = s->reversed ? LAYERS - 1 - l : l;
    s->layer_offset[l] = (size_t)position * (REGION + s->layer_gap);
  }
  s->slot_bytes = (size_t)LAYERS * REGION + (size_t)(LAYERS - 1) * s->layer_gap;
  s->stride = s->slot_bytes + s->slot_padding;
  s->footprint = (size_t)(s->slots - 1) * s->stride + s->slot_bytes;
}

/* One request as both sides agree on it, and where each side keeps it. */
struct request {
  uint64_t id;
  uint64_t prompt_len;
  uint64_t chunk;         /* tokens of the first send; 0: one send */
  uint64_t cached_prefix; /* decode side: tokens it already holds (block-aligned) */
  int32_t prefill_slots[MAX_BLOCKS];
  int32_t decode_slots[MAX_BLOCKS];
};

static const struct request REQUESTS[N_REQUESTS] = {
    /* 40 tokens: 3 blocks, the last one partial. */
    {101, 40, 0, 0, {5, 0, 9, -1}, {3, 10, 1, -1}},
    /* One full block. */
    {102, 16, 0, 0, {14, -1, -1, -1}, {7, -1, -1, -1}},
    /* 50 tokens in two chunks (32 + 18); the decode side has the first block cached. */
    {103, 50, 32, 16, {2, 11, 7, 3}, {11, 0, 5, 8}},
};

static unsigned blocks(uint64_t tokens) { return (unsigned)((tokens + TPB - 1) / TPB); }

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  exit(1);
}

/* Exits naming the call and kvferry's last error unless `status` is KVFERRY_OK. */
static void check(int status, const char *call) {
  if (status == KVFERRY_OK) return;
  char why[1024];
  kvferry_last_error(why, sizeof why);
  die("%s: %s (%s)", call, kvferry_status_name(status), why);
}

static uint64_t mix(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t row_seed(uint64_t salt, uint64_t request, unsigned layer, unsigned kv,
                         unsigned head, uint64_t token) {
  uint64_t h = mix(salt);
  h = mix(h ^ request);
  h = mix(h ^ layer);
  h = mix(h ^ kv);
  h = mix(h ^ head);
  return mix(h ^ token);
}

static void fill_row(uint8_t *row, uint64_t seed) {
  for (unsigned w = 0; w < ROW / 8; w++) {
    uint64_t v = mix(seed + w);
    memcpy(row + 8 * w, &v, 8);
  }
}

/* Whether the row holds the pattern of `seed`. */
static int row_matches(const uint8_t *row, uint64_t seed) {
  for (unsigned w = 0; w < ROW / 8; w++) {
    uint64_t v = mix(seed + w);
    if (memcmp(row + 8 * w, &v, 8) != 0) return 0;
  }
  return 1;
}

static size_t row_offset(const struct side *s, int32_t slot, unsigned layer, unsigned kv,
                         unsigned head, uint64_t token) {
  return (size_t)slot * s->stride + s->layer_offset[layer] + (size_t)kv * BUFFER +
         (size_t)head * TPB * ROW + (size_t)(token % TPB) * ROW;
}

/* Writes the pattern into every row of blocks [first, last) of a request. */
static void fill_blocks(struct side *s, const int32_t *slots, uint64_t request, unsigned first,
                        unsigned last, uint64_t salt) {
  for (unsigned b = first; b < last; b++)
    for (uint64_t t = (uint64_t)b * TPB; t < (uint64_t)(b + 1) * TPB; t++)
      for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned kv = 0; kv < 2; kv++)
          for (unsigned h = 0; h < HEADS; h++)
            fill_row(s->pool + row_offset(s, slots[b], l, kv, h, t),
                     row_seed(salt, request, l, kv, h, t));
}

/* The JSON configuration of one side, over its pool. */
static char *config_json(const struct side *s, const char *plugin_dir, const char *transport,
                         const char *secret) {
  size_t cap = 16384, n = 0;
  char *out = malloc(cap);
  if (!out) die("out of memory");
#define PUT(...)                                                \
  do {                                                          \
    int k = snprintf(out + n, cap - n, __VA_ARGS__);            \
    if (k < 0 || (size_t)k >= cap - n) die("config too long");  \
    n += (size_t)k;                                             \
  } while (0)
  PUT("{\"version\": %d, \"instance\": \"%s-c\", \"role\": \"%s\", ", KVFERRY_CONFIG_VERSION,
      s->name, s->role);
  PUT("\"label\": \"c test gqa %ux%ux%u\", \"architecture\": \"LlamaForCausalLM\", ", LAYERS,
      HEADS, HEAD_DIM);
  PUT("\"planner\": \"kvferry.default\", ");
  /* "-": none, so the library looks where it is installed (kvferry/planners beside it). */
  if (strcmp(plugin_dir, "-") != 0) PUT("\"plugin_dir\": \"%s\", ", plugin_dir);
  PUT("\"transport\": \"%s\", \"listen\": \"127.0.0.1:0\", \"secret\": \"%s\", ", transport,
      secret);
  PUT("\"timeout_ms\": 20000, \"lease_ms\": 20000, ");
  PUT("\"rank\": {\"mapping\": \"tp1\", \"instance_rank\": 0, \"layers_per_pp\": [%u], ", LAYERS);
  PUT("\"page_table\": {\"tokens_per_block\": %u, ", TPB);
  PUT("\"pools\": [{\"base\": %" PRIuPTR ", \"slot_bytes\": %zu, \"slot_stride\": %zu, "
      "\"num_slots\": %u, \"memory_type\": \"dram\"}], ",
      (uintptr_t)s->pool, s->slot_bytes, s->stride, s->slots);
  PUT("\"groups\": [{\"kind\": \"paged\", \"layers\": [");
  for (unsigned l = 0; l < LAYERS; l++) PUT("%s{\"local\": %u, \"global\": %u}", l ? ", " : "", l, l);
  PUT("], \"views\": [{\"pool\": 0, \"roles\": [\"key\", \"value\"], \"entries\": [");
  for (unsigned l = 0; l < LAYERS; l++)
    for (unsigned kv = 0; kv < 2; kv++)
      PUT("%s{\"local_layer\": %u, \"offset\": %zu, \"size\": %u}", (l || kv) ? ", " : "", l,
          s->layer_offset[l] + (size_t)kv * BUFFER, BUFFER);
  PUT("], \"layout\": {\"kind\": \"hnd\", \"dtype\": \"bf16\", \"elem_bits\": %u, "
      "\"shard_unit_bytes\": %u}}]}]}}}",
      ELEM_BYTES * 8, TPB * ROW);
#undef PUT
  return out;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Waits on the wake descriptor and drains events into `got` until `want` arrived. */
static void wait_events(kvferry_agent *agent, kvferry_event *got, size_t want, double limit_s) {
  size_t have = 0;
  double deadline = now_s() + limit_s;
  struct pollfd fd = {.fd = kvferry_agent_wake_fd(agent), .events = POLLIN, .revents = 0};
  if (fd.fd < 0) die("kvferry_agent_wake_fd: %d", fd.fd);
  while (have < want) {
    double left = deadline - now_s();
    if (left <= 0) die("timed out with %zu of %zu events", have, want);
    int ready = poll(&fd, 1, (int)(left * 1000) + 1);
    if (ready < 0 && errno != EINTR) die("poll: %s", strerror(errno));
    size_t n = 0;
    /* A small array on purpose: events that do not fit wait for the next call. */
    check(kvferry_agent_poll(agent, got + have, want - have < 2 ? want - have : 2, &n),
          "kvferry_agent_poll");
    have += n;
  }
}

static const struct request *find_request(uint64_t id) {
  for (int r = 0; r < N_REQUESTS; r++)
    if (REQUESTS[r].id == id) return &REQUESTS[r];
  return NULL;
}

static void table(kvferry_slot_table *t, const int32_t *slots, unsigned n) {
  t->slots = slots;
  t->len = n;
}

static int prefill(const char *endpoint_file, const char *plugin_dir, const char *transport,
                   const char *secret) {
  struct side s = {.name = "prefill", .role = "context", .slots = 16};
  side_init(&s);
  s.pool = aligned_alloc(4096, (s.footprint + 4095) / 4096 * 4096);
  if (!s.pool) die("cannot allocate the pool");
  memset(s.pool, FOREIGN, s.footprint);

  char *json = config_json(&s, plugin_dir, transport, secret);
  kvferry_agent *agent = NULL;
  check(kvferry_agent_start(json, &agent), "kvferry_agent_start");
  free(json);

  size_t len = 0;
  check(kvferry_agent_endpoint(agent, NULL, 0, &len), "kvferry_agent_endpoint (size query)");
  char *endpoint = malloc(len + 1);
  if (!endpoint) die("out of memory");
  check(kvferry_agent_endpoint(agent, endpoint, len + 1, &len), "kvferry_agent_endpoint");
  /* The metadata, for a decode rank that takes it by kvferry_agent_add_peer; written before
   * the endpoint file appears. */
  size_t meta_len = 0;
  check(kvferry_agent_local_metadata(agent, NULL, 0, &meta_len), "kvferry_agent_local_metadata");
  uint8_t *meta = malloc(meta_len);
  if (!meta) die("out of memory");
  check(kvferry_agent_local_metadata(agent, meta, meta_len, &meta_len),
        "kvferry_agent_local_metadata");
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.meta", endpoint_file);
  FILE *m = fopen(tmp, "wb");
  if (!m || fwrite(meta, 1, meta_len, m) != meta_len || fclose(m) != 0) die("cannot write %s", tmp);
  free(meta);
  snprintf(tmp, sizeof tmp, "%s.tmp", endpoint_file);
  FILE *f = fopen(tmp, "w");
  if (!f || fputs(endpoint, f) < 0 || fclose(f) != 0) die("cannot write %s", tmp);
  if (rename(tmp, endpoint_file) != 0) die("cannot rename %s: %s", tmp, strerror(errno));
  fprintf(stderr, "prefill: listening on %s\n", endpoint);

  for (int r = 0; r < N_REQUESTS; r++) {
    const struct request *q = &REQUESTS[r];
    unsigned n = blocks(q->prompt_len);
    kvferry_slot_table t;
    uint64_t start = 0;
    if (q->chunk) {
      /* The first chunk: its blocks computed, its table covering them alone. */
      unsigned first = blocks(q->chunk);
      fill_blocks(&s, q->prefill_slots, q->id, 0, first, SALT_PREFILL);
      table(&t, q->prefill_slots, first);
      check(kvferry_agent_send(agent, q->id, &t, 1, 0, q->chunk, q->prompt_len, false, "decode-c"),
            "kvferry_agent_send (first chunk)");
      fill_blocks(&s, q->prefill_slots, q->id, first, n, SALT_PREFILL);
      start = q->chunk;
    } else {
      fill_blocks(&s, q->prefill_slots, q->id, 0, n, SALT_PREFILL);
    }
    table(&t, q->prefill_slots, n);
    /* The chunked request is bound to the decode instance; the others go to whoever claims them. */
    check(kvferry_agent_send(agent, q->id, &t, 1, start, q->prompt_len, q->prompt_len, true,
                             q->chunk ? "decode-c" : NULL),
          "kvferry_agent_send");
  }

  kvferry_event events[N_REQUESTS];
  wait_events(agent, events, N_REQUESTS, 30);
  uint64_t bytes = 0;
  for (int e = 0; e < N_REQUESTS; e++) {
    if (events[e].kind != KVFERRY_EVENT_SENT)
      die("prefill: request %" PRIu64 " ended in kind %u failure %u: %s (peer %s)",
          events[e].request, (unsigned)events[e].kind, (unsigned)events[e].failure,
          events[e].detail, events[e].peer);
    if (!find_request(events[e].request)) die("prefill: an event for request %" PRIu64, events[e].request);
    bytes += events[e].bytes;
  }
  /* The sources are the engine's again; they must be unchanged. */
  for (int r = 0; r < N_REQUESTS; r++) {
    const struct request *q = &REQUESTS[r];
    for (uint64_t t = 0; t < (uint64_t)blocks(q->prompt_len) * TPB; t++)
      for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned kv = 0; kv < 2; kv++)
          for (unsigned h = 0; h < HEADS; h++)
            if (!row_matches(s.pool + row_offset(&s, q->prefill_slots[t / TPB], l, kv, h, t),
                             row_seed(SALT_PREFILL, q->id, l, kv, h, t)))
              die("prefill: source row of request %" PRIu64 " token %" PRIu64 " changed", q->id, t);
  }
  kvferry_agent_destroy(agent);
  free(s.pool);
  free(endpoint);
  printf("prefill: sent %d requests, bytes=%" PRIu64 "\n", N_REQUESTS, bytes);
  return 0;
}

static int decode(const char *endpoint_file, const char *plugin_dir, const char *transport,
                  const char *secret) {
  struct side s = {.name = "decode",
                   .role = "generation",
                   .slots = 12,
                   .layer_gap = 128,
                   .slot_padding = 256,
                   .reversed = 1};
  side_init(&s);
  size_t alloc = (s.footprint + 4095) / 4096 * 4096;
  s.pool = aligned_alloc(4096, alloc);
  if (!s.pool) die("cannot allocate the pool");
  memset(s.pool, CANARY, alloc);

  char endpoint[256] = {0};
  double deadline = now_s() + 30;
  for (;;) {
    FILE *f = fopen(endpoint_file, "r");
    if (f) {
      size_t n = fread(endpoint, 1, sizeof endpoint - 1, f);
      fclose(f);
      endpoint[n] = 0;
      if (n > 0) break;
    }
    if (now_s() > deadline) die("decode: no endpoint in %s", endpoint_file);
    struct timespec pause = {0, 20 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }

  char *json = config_json(&s, plugin_dir, transport, secret);
  kvferry_agent *agent = NULL;
  check(kvferry_agent_start(json, &agent), "kvferry_agent_start");
  free(json);
  size_t len = 0;
  if (kvferry_agent_endpoint(agent, NULL, 0, &len) != KVFERRY_ERR_ROLE)
    die("decode: a decode rank reported an endpoint");

  /* The prefill's metadata, as an engine that exchanges it on its own channel would add it. */
  char meta_file[4096];
  snprintf(meta_file, sizeof meta_file, "%s.meta", endpoint_file);
  FILE *m = fopen(meta_file, "rb");
  if (!m) die("decode: cannot open %s", meta_file);
  uint8_t meta[65536];
  size_t meta_len = fread(meta, 1, sizeof meta, m);
  fclose(m);
  check(kvferry_agent_add_peer(agent, meta, meta_len), "kvferry_agent_add_peer");

  const char *endpoints[] = {endpoint};
  for (int r = 0; r < N_REQUESTS; r++) {
    const struct request *q = &REQUESTS[r];
    /* The cached prefix: this side's own rows, there before the expect. */
    fill_blocks(&s, q->decode_slots, q->id, 0, blocks(q->cached_prefix), SALT_CACHED);
    kvferry_slot_table t;
    table(&t, q->decode_slots, blocks(q->prompt_len));
    /* Request 102 names no endpoint: the metadata added above is all the agent has. */
    size_t n_endpoints = q->id == 102 ? 0 : 1;
    check(kvferry_agent_expect(agent, q->id, "prefill-c", endpoints, n_endpoints, 0,
                               q->prompt_len, q->cached_prefix, &t, 1, NULL, 0),
          "kvferry_agent_expect");
  }

  kvferry_event events[N_REQUESTS];
  wait_events(agent, events, N_REQUESTS, 30);
  uint64_t bytes = 0;
  for (int e = 0; e < N_REQUESTS; e++) {
    if (events[e].kind != KVFERRY_EVENT_RECEIVED)
      die("decode: request %" PRIu64 " ended in kind %u failure %u: %s (peer %s)",
          events[e].request, (unsigned)events[e].kind, (unsigned)events[e].failure,
          events[e].detail, events[e].peer);
    bytes += events[e].bytes;
  }
  kvferry_agent_destroy(agent);

  /* Every byte: rows of the requests against their pattern, everything else the canary. */
  uint8_t *claimed = calloc(alloc, 1);
  if (!claimed) die("out of memory");
  uint64_t landed = 0, cached = 0, tail_rows = 0;
  for (int r = 0; r < N_REQUESTS; r++) {
    const struct request *q = &REQUESTS[r];
    for (uint64_t t = 0; t < (uint64_t)blocks(q->prompt_len) * TPB; t++)
      for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned kv = 0; kv < 2; kv++)
          for (unsigned h = 0; h < HEADS; h++) {
            size_t at = row_offset(&s, q->decode_slots[t / TPB], l, kv, h, t);
            const uint8_t *row = s.pool + at;
            memset(claimed + at, 1, ROW);
            if (t < q->cached_prefix) {
              if (!row_matches(row, row_seed(SALT_CACHED, q->id, l, kv, h, t)))
                die("decode: request %" PRIu64 " token %" PRIu64 " layer %u %s head %u: the "
                    "cached row was overwritten (byte 0 is %#04x)",
                    q->id, t, l, kv ? "V" : "K", h, row[0]);
              cached += ROW;
            } else if (row_matches(row, row_seed(SALT_PREFILL, q->id, l, kv, h, t))) {
              landed += ROW;
              tail_rows += t >= q->prompt_len;
            } else if (t < q->prompt_len) {
              die("decode: request %" PRIu64 " token %" PRIu64 " layer %u %s head %u (slot %d): "
                  "wrong bytes (byte 0 is %#04x)",
                  q->id, t, l, kv ? "V" : "K", h, q->decode_slots[t / TPB], row[0]);
            } else {
              /* Past the prompt: untouched, whole rows only. */
              for (unsigned b = 0; b < ROW; b++)
                if (row[b] != CANARY)
                  die("decode: request %" PRIu64 " token %" PRIu64 " (past the prompt) layer "
                      "%u: byte %u is %#04x, neither the pattern nor the canary",
                      q->id, t, l, b, row[b]);
            }
          }
  }
  uint64_t untouched = 0;
  for (size_t i = 0; i < alloc; i++) {
    if (claimed[i]) continue;
    if (s.pool[i] != CANARY)
      die("decode: byte %zu (slot %zu, offset %zu) outside every request is %#04x", i,
          i / s.stride, i % s.stride, s.pool[i]);
    untouched++;
  }
  if (landed != bytes)
    die("decode: %" PRIu64 " bytes hold the pattern, the agent reported %" PRIu64, landed, bytes);
  free(claimed);
  free(s.pool);
  printf("decode: verified %d requests, every byte: bytes=%" PRIu64 " cached=%" PRIu64
         " untouched=%" PRIu64 " tail_rows=%" PRIu64 "\n",
         N_REQUESTS, bytes, cached, untouched, tail_rows);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 4 || argc > 5) {
    fprintf(stderr, "usage: %s prefill|decode ENDPOINT_FILE PLUGIN_DIR|- [TRANSPORT]\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *transport = argc == 5 ? argv[4] : "tcp";
  const char *secret = getenv("KVFERRY_TEST_SECRET");
  if (!secret || !*secret) secret = "kvferry c api test secret";
  fprintf(stderr, "%s: kvferry %s\n", argv[1], kvferry_version());
  if (strcmp(argv[1], "prefill") == 0) return prefill(argv[2], argv[3], transport, secret);
  if (strcmp(argv[1], "decode") == 0) return decode(argv[2], argv[3], transport, secret);
  fprintf(stderr, "unknown side %s\n", argv[1]);
  return 2;
}
