/* kernels/cpu_mask.py's kernel (its docstring says how and why). */
#include <math.h>
#include <stdint.h>

/* For r < R: row = rows ? rows[r] : r; logits[row, t] = -inf where bit t of mask[row] is 0,
   for t < V (logits rows `stride` floats apart; mask rows W words; columns past 32 W too). */
void apply_bitmask(float *logits, const int32_t *mask, const int64_t *rows, int64_t R, int64_t V,
                   int64_t stride, int64_t W) {
    const float ninf = -INFINITY;
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = rows ? rows[r] : r;
        float *out = logits + row * stride;
        const uint32_t *m = (const uint32_t *)(mask + row * W);
        const int64_t covered = 32 * W < V ? 32 * W : V;
        for (int64_t w = 0; 32 * w < covered; w++) {
            const uint32_t bits = m[w];
            const int64_t base = 32 * w, end = base + 32 < covered ? base + 32 : covered;
            if (bits == 0xffffffffu) continue;
            if (bits == 0) {
                for (int64_t t = base; t < end; t++) out[t] = ninf;
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) out[t] = ninf;
        }
        for (int64_t t = covered; t < V; t++) out[t] = ninf;
    }
}
