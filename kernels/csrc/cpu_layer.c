/* kernels/cpu_layer.py's kernel: the stages are the separate kernels' own code, built into this one
   library (its docstring says why). */
#include "int4_gemm.c"
#include "int8_gemm.c"
#include "cpu_paged.c"
#include "cpu_fused.c"

/* A linear's packed weight: N outputs, K inputs in G groups of 32 (padded), and its kind: 4, 5, 6,
   8, IQ4 (9), INT3 (3) or INT2 (2) for `int4_gemm.PackedGroups` (float16 scales, and offsets
   where `offs`; the sub-scaled INT3 and INT2 their halves' integer scales too), F16 (16)
   or BF16 (17) for its 16-bit widths (no scales), INT8_CHANNELS for `int8_gemm.PackedInt8`
   (float32 scales, one per output). */
#define INT8_CHANNELS 1
typedef struct {
    const void *w;
    const void *sc;
    int64_t N, K, G, kind, offs;
} Packed;

/* One layer: its two norms' weights, its four linears and its K/V pool buffers [S, Hkv, D]. */
typedef struct {
    const float *norm1, *norm2;
    Packed qkv, o, gate_up, down;
    float *k_buf, *v_buf;
} Layer;

/* The step, shared by every layer: T token rows (each a decode row: its keys slots [t, :lens[t]],
   the new one at out_slots[t] among them), the shapes, and the scratch the layers reuse. */
typedef struct {
    int64_t T, H, Hq, Hkv, D, I, L, splits;
    float eps, scale;
    const float *cos, *sin;      /* [T, D] */
    const int64_t *out_slots;    /* [T] */
    const int64_t *slots, *lens; /* [T, L], [T] */
    float *h, *qkv, *q, *attn, *lse, *part, *o, *gate_up, *act, *xs, *xsum;
    int8_t *a;
} Step;

/* out [T, N] = x @ W.T: its GEMM's body over the step's scratch, then a barrier (the next
   stage reads out, and the next linear rewrites the quantized rows this one reads). */
static inline void linear(const Packed *p, const float *x, float *out, const Step *s) {
#define GROUPED(bits, offs) \
    linear_body(x, s->a, s->xs, s->xsum, p->w, p->sc, 0, out, s->T, p->N, p->K, p->G, bits, offs)
    if (p->kind == 4 && p->offs)
        GROUPED(4, 1);
    else if (p->kind == 4)
        GROUPED(4, 0);
    else if (p->kind == 5 && p->offs)
        GROUPED(5, 1);
    else if (p->kind == 5)
        GROUPED(5, 0);
    else if (p->kind == 6)
        GROUPED(6, 0);
    else if (p->kind == IQ4)
        GROUPED(IQ4, 0);
    else if (p->kind == INT3)
        GROUPED(INT3, 0);
    else if (p->kind == INT2)
        GROUPED(INT2, 0);
    else if (p->kind == 8 && p->offs)
        GROUPED(8, 1);
    else if (p->kind == 8)
        GROUPED(8, 0);
    else if (p->kind == F16)
        half_body(x, p->w, 0, out, s->T, p->N, p->K, p->G * GROUP, F16);
    else if (p->kind == BF16)
        half_body(x, p->w, 0, out, s->T, p->N, p->K, p->G * GROUP, BF16);
    else
        int8_body(x, (int16_t *)s->a, s->xs, p->w, p->sc, 0, out, s->T, p->N, p->K, p->G * 32);
#pragma omp barrier
}

/* One layer inside the region: x [T, H] (the last layer's MLP output) is added to residual and
   replaced by this layer's MLP output; residual [T, H] is the stream. */
static void layer(const Layer *w, const Step *s, float *x, float *residual) {
    const int64_t T = s->T, H = s->H, D = s->D, I = s->I, width = (s->Hq + 2 * s->Hkv) * D;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, residual + t * H, w->norm1, s->h + t * H, H, s->eps);
    linear(&w->qkv, s->h, s->qkv, s);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = s->out_slots[t] * s->Hkv * D;
        rope_row(s->qkv + t * width, s->cos + t * D, s->sin + t * D, s->q + t * s->Hq * D,
                 w->k_buf + slot, w->v_buf + slot, s->Hq, s->Hkv, D);
    }
    paged_decode_body(s->q, w->k_buf, w->v_buf, s->slots, s->lens, s->attn, s->lse, T, s->Hq,
                      s->Hkv, D, s->L, s->scale, 0.0f, s->splits, s->part, -1);
    linear(&w->o, s->attn, s->o, s);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        norm_row(s->o + t * H, residual + t * H, w->norm2, s->h + t * H, H, s->eps);
    linear(&w->gate_up, s->h, s->gate_up, s);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) silu_row(s->gate_up + t * 2 * I, s->act + t * I, I);
    linear(&w->down, s->act, x, s);
}

/* layers [n] over x and residual [T, H], in one parallel region. */
void decode_layers(const Layer *layers, int64_t n, const Step *s, float *x, float *residual) {
#pragma omp parallel
    for (int64_t l = 0; l < n; l++) layer(layers + l, s, x, residual);
}
