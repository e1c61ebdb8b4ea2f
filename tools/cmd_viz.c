/*
 * cmd_viz.c -- `mha viz`: the attention weights of every head of one batch
 * item, and their mean over heads, as labelled heatmaps in a PNG (libpng,
 * when the build found it) or in the terminal.
 *
 * The PNG layout, in pixels (tests/check_viz.py mirrors it to check the
 * size of the image and the colour of every cell):
 *
 *   budget  = clamp(2304 / (gc + 1), 64, 256)   cells per axis of a panel,
 *             gc = ceil(sqrt(H)) panels per row of the grid of heads
 *   f       = ceil(L / budget) per axis: blocks of f x f weights are
 *             max-pooled into one cell (f = 1 when L <= budget)
 *   cell    = clamp(budget / max(rows, cols), 1, 32) px, square
 *   ls      = 2 if cell >= 16 else 1: label text scale (5x7 glyphs drawn
 *             ls x ls, 6 ls px apart); titles at scale 2, caption at 1
 *   labels  = at most 6 chars, on the positions p (from 1) that are
 *             multiples of S, the least of 1, 2, 5, 10, 20, 50, ... with
 *             S >= ceil(12 ls / cell) * f, and on p = 1 when
 *             floor((S - 1) / f) * cell >= 12 ls; drawn in p's cell
 *   RW      = 6 ls * (longest row label) + 4,   CH = the same, columns
 *   TH      = 24, the title band ("head 0" .. "head H-1", "mean");
 *             IW = max(cols * cell, 12 * longest title)
 *   panel   = PW x PH = (RW + IW) x (TH + CH + rows * cell); its map at
 *             (+RW, +TH + CH)
 *   M = 12 margin, G = 16 gap, CAP = 16 the caption band: head h (from 0)
 *   at (M + (h % gc)(PW + G), M + CAP + (h / gc)(PH + G)); the mean panel
 *   at x = M + gc (PW + G) + G, top row; the colour bar (16 px wide,
 *   max(rows * cell, 64) tall, level with the maps) at mean + PW + G, its
 *   ticks (0, max/2, max, "%.3g", scale ls) 4 px to its right.
 *   width  = max(bar x + 20 + 6 ls * (longest tick) + M,  2M + 6 * caption)
 *   height = max(grid bottom, bar bottom) + M
 *
 * A cell's colour is ramp(w / w_max), w_max the largest weight over all
 * panels (one scale, the colour bar's), ramp a 5-stop dark-blue ->
 * green -> yellow gradient, monotonic in lightness.
 */
#define _POSIX_C_SOURCE 200809L
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "font.h"
#include "heatmap.h"
#include "run_setup.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef MHA_HAVE_PNG
#include <png.h>
#endif

enum {
    LABEL_CHARS = 6,     /* labels are cut to this many characters */
    ASCII_CELLS = 64,    /* cells per axis of a terminal map */
    PNG_MAX_SIDE = 16384 /* refused beyond (thousands of heads) */
};

typedef char label[24];  /* a token cut to LABEL_CHARS, or a position */

/* The maps of one batch item: H heads and their mean, (H + 1, Lq, Lt),
 * Lt = Lk plus the bias_k and zero keys (their weights are only ever held
 * max-pooled, below); labels of both axes. */
typedef struct viz_maps {
    int64_t H, Lq, Lk, Lt;
    label *rows, *cols;
    char *row_ch, *col_ch;  /* one character per position, for --ascii */
} viz_maps;

static void maps_free(viz_maps *m)
{
    free(m->rows);
    free(m->cols);
    free(m->row_ch);
    free(m->col_ch);
}

/* ---- labels ------------------------------------------------------------- */

/* A display label: surrounding blanks dropped, each UTF-8 sequence or
 * control character shown as '?', cut to LABEL_CHARS characters. */
static void label_from(label out, const char *s, size_t len)
{
    while (len && (*s == ' ' || *s == '\t'))
        s++, len--;
    while (len && (s[len - 1] == ' ' || s[len - 1] == '\t' ||
                   s[len - 1] == '\r'))
        len--;
    size_t n = 0;
    for (size_t i = 0; i < len && n < LABEL_CHARS; i++) {
        const unsigned char c = (unsigned char)s[i];
        if ((c & 0xC0) == 0x80)
            continue;               /* a UTF-8 continuation byte */
        out[n++] = c >= ' ' && c <= '~' ? (char)c : '?';
    }
    out[n] = 0;
}

/*
 * Reads the tokens of `opt` (a file of one token per line when it has
 * several lines, else whitespace-separated) into want labels; the count
 * must be `want`.
 */
static int read_tokens(const char *opt, const char *path, int64_t want,
                       const char *axis, label *out)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return tool_fail("viz", "--%s: cannot open %s: %s", opt, path,
                         strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    int rc = buf ? 0 : tool_fail("viz", "--%s: out of memory", opt);
    while (!rc) {
        if (len + 1 >= cap) {
            char *nb = cap < ((size_t)1 << 30) ? realloc(buf, cap *= 2) : NULL;
            if (!nb) {
                rc = tool_fail("viz", "--%s: %s is too large", opt, path);
                break;
            }
            buf = nb;
        }
        const size_t got = fread(buf + len, 1, cap - 1 - len, f);
        len += got;
        if (got == 0) {
            if (ferror(f))
                rc = tool_fail("viz", "--%s: cannot read %s", opt, path);
            break;
        }
    }
    fclose(f);
    if (rc) {
        free(buf);
        return rc;
    }
    buf[len] = 0;
    /* Several lines (a final newline does not count): one token per line,
     * blank ones included; else blank-separated words. */
    size_t body = len;
    if (body && buf[body - 1] == '\n')
        body--;
    const int per_line = memchr(buf, '\n', body) != NULL;
    static const char blank[] = " \t\r\n\v\f";
    int64_t n = 0;
    for (size_t i = 0, j; i < body || (per_line && i == body); i = j + 1) {
        if (!per_line) {
            while (i < body && strchr(blank, buf[i]))
                i++;
            if (i == body)
                break;
        }
        for (j = i; j < body && (per_line ? buf[j] != '\n'
                                           : !strchr(blank, buf[j]));
             j++)
            ;
        if (n < want)
            label_from(out[n], buf + i, j - i);
        n++;
        if (j == body)
            break;
    }
    free(buf);
    if (n != want)
        return tool_fail("viz", "--%s %s has %lld token%s, but the %s has "
                         "%lld position%s", opt, path, (long long)n,
                         n == 1 ? "" : "s", axis, (long long)want,
                         want == 1 ? "" : "s");
    return 0;
}

/* Position labels (from 1), the tokens when given, and names for the keys
 * add_bias_kv and add_zero_attn append. */
static int make_labels(const tool_opt *o, int n, const run_setup *r,
                       viz_maps *m)
{
#define OPT(name) tool_get(o, n, name)
    m->rows = calloc((size_t)m->Lq, sizeof *m->rows);
    m->cols = calloc((size_t)m->Lt, sizeof *m->cols);
    if (!m->rows || !m->cols)
        return tool_fail("viz", "out of memory for the labels");
    for (int64_t i = 0; i < m->Lq; i++)
        snprintf(m->rows[i], sizeof(label), "%lld", (long long)(i + 1));
    for (int64_t j = 0; j < m->Lk; j++)
        snprintf(m->cols[j], sizeof(label), "%lld", (long long)(j + 1));
    int64_t j = m->Lk;
    if (r->c.add_bias_kv)
        snprintf(m->cols[j++], sizeof(label), "bias_k");
    if (r->c.add_zero_attn)
        snprintf(m->cols[j++], sizeof(label), "zero");
    const int row_tok = OPT("tokens") != NULL,
              col_tok = OPT("key-tokens") || (row_tok && !OPT("key"));
    if (row_tok &&
        read_tokens("tokens", OPT("tokens"), m->Lq, "query", m->rows))
        return 1;
    if (row_tok && !OPT("key"))  /* self-attention: the keys are the tokens */
        memcpy(m->cols, m->rows, (size_t)m->Lk * sizeof *m->cols);
    if (OPT("key-tokens") &&
        read_tokens("key-tokens", OPT("key-tokens"), m->Lk, "key", m->cols))
        return 1;
    /* For --ascii: a token's first character ('_' if blank), a position's
     * last digit, the extra keys' initials ('b', 'z'). */
    m->row_ch = malloc((size_t)m->Lq);
    m->col_ch = malloc((size_t)m->Lt);
    if (!m->row_ch || !m->col_ch)
        return tool_fail("viz", "out of memory for the labels");
    for (int64_t i = 0; i < m->Lq; i++)
        m->row_ch[i] = !row_tok ? (char)('0' + (i + 1) % 10)
                     : m->rows[i][0] ? m->rows[i][0] : '_';
    for (int64_t k = 0; k < m->Lt; k++)
        m->col_ch[k] = k < m->Lk && !col_tok ? (char)('0' + (k + 1) % 10)
                     : m->cols[k][0] ? m->cols[k][0] : '_';
#undef OPT
    return 0;
}

/* ---- the weights -------------------------------------------------------- */

/* Narrows a mask with a batch dimension (of 1 or B) to item n. */
static int mask_item(const char *opt, mha_mask *mk, int batch_dim,
                     int64_t B, int64_t n)
{
    if (mk->kind == MHA_MASK_NONE || mk->ndim <= batch_dim)
        return 0;
    if (mk->shape[0] != 1 && mk->shape[0] != B)
        return tool_fail("viz", "--%s has batch %lld, the query %lld", opt,
                         (long long)mk->shape[0], (long long)B);
    if (mk->shape[0] == 1)
        return 0;
    int64_t per = 1;
    for (int d = 1; d < mk->ndim; d++)
        per *= mk->shape[d];
    const size_t size = mk->kind == MHA_MASK_ADDITIVE ? sizeof(float) : 1;
    mk->data = (const char *)mk->data + (size_t)(n * per) * size;
    mk->shape[0] = 1;
    return 0;
}

/* ---- pooling ------------------------------------------------------------ */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The H + 1 maps (heads, then the mean) max-pooled by fr x fc: cell
 * (h, i / fr, j / fc) holds the largest weight of its block. */
typedef struct pooled {
    int64_t fr, fc, nr, nc;
    float *p;   /* (H + 1, nr, nc) */
} pooled;

static int pooled_init(pooled *P, const viz_maps *m, int64_t fr, int64_t fc)
{
    P->fr = fr;
    P->fc = fc;
    P->nr = ceil_div(m->Lq, fr);
    P->nc = ceil_div(m->Lt, fc);
    P->p = calloc((size_t)((m->H + 1) * P->nr * P->nc), sizeof *P->p);
    return P->p ? 0 : tool_fail("viz", "out of memory for the maps");
}

/* Folds row i of map h (Lt weights) into the cells of P. */
static void pool_row(pooled *P, const viz_maps *m, int64_t h, int64_t i,
                     const float *row)
{
    float *d = P->p + (h * P->nr + i / P->fr) * P->nc;
    for (int64_t j = 0; j < m->Lt; j++)
        if (row[j] > d[j / P->fc])
            d[j / P->fc] = row[j];
}

/* Copies rows i0 .. i0 + n - 1 of every (Lq, Lk) plane of an attention
 * mask into buf: the slice's own mask. */
static void mask_rows(const mha_mask *mk, int64_t Lq, int64_t i0, int64_t n,
                      void *buf, mha_mask *out)
{
    const int64_t Lk = mk->shape[mk->ndim - 1];
    const size_t size = mk->kind == MHA_MASK_ADDITIVE ? sizeof(float) : 1;
    int64_t planes = 1;
    for (int d = 0; d < mk->ndim - 2; d++)
        planes *= mk->shape[d];
    for (int64_t t = 0; t < planes; t++)
        memcpy((char *)buf + (size_t)(t * n * Lk) * size,
               (const char *)mk->data + (size_t)((t * Lq + i0) * Lk) * size,
               (size_t)(n * Lk) * size);
    *out = *mk;
    out->data = buf;
    out->shape[mk->ndim - 2] = n;
}

/* The memory for one slice's weights: 256 MiB, or MHA_VIZ_SLICE_BYTES
 * (an integer >= 1: the tests draw in many slices with a small one). */
static double slice_bytes(void)
{
    const char *env = getenv("MHA_VIZ_SLICE_BYTES");
    char *end;
    const double v = env ? strtod(env, &end) : 0.0;
    return env && *env && !*end && v >= 1.0 ? v : 256.0 * 1048576.0;
}

/*
 * Runs the forward pass for batch item n and folds its per-head weights
 * and their mean into the pooled maps P[0 .. np): the query rows go
 * through in slices (mha_forward_args.q_start / q_total) whose weights fit
 * in slice_bytes(), so a long sequence never holds its (H + 1) Lq Lt
 * weights at once.  Without dropout only item n is computed; with --train
 * the whole batch runs, since the dropout mask depends on the item.
 */
static int item_weights(const run_setup *r, int64_t n, viz_maps *m,
                        pooled *P, int np)
{
    mha_forward_args a = r->a;
    const mha_config *c = &r->c;
    const int64_t B = a.batch, Lq = a.q_len, Lk = a.kv_len, E = c->embed_dim;
    if (n >= B)
        return tool_fail("viz", "--batch-index %lld is out of range: the "
                         "query has batch %lld (items 0..%lld)", (long long)n,
                         (long long)B, (long long)(B - 1));
    /* The masks' ranks and the attention mask's last dimensions, checked
     * as the library would check them, before a mask is narrowed to the
     * item or sliced by its rows (and an index past shape[3] is taken). */
    const mha_mask *am = &a.attn_mask, *km = &a.key_padding_mask;
    const char *aname = am->kind == MHA_MASK_BLOCK ? "block-mask"
                                                   : "attn-mask";
    if (am->kind != MHA_MASK_NONE && (am->ndim < 2 || am->ndim > 4))
        return tool_fail("viz", "--%s must have 2, 3 or 4 dimensions "
                         "((Lq,Lk), (B,Lq,Lk) or (B,H,Lq,Lk)), got %d",
                         aname, am->ndim);
    if (am->kind != MHA_MASK_NONE && (am->shape[am->ndim - 2] != Lq ||
                                      am->shape[am->ndim - 1] != Lk))
        return tool_fail("viz", "--%s has last dimensions (%lld, %lld), "
                         "expected (Lq=%lld, Lk=%lld)", aname,
                         (long long)am->shape[am->ndim - 2],
                         (long long)am->shape[am->ndim - 1], (long long)Lq,
                         (long long)Lk);
    if (km->kind != MHA_MASK_NONE && km->ndim != 1 && km->ndim != 2)
        return tool_fail("viz", "--key-mask must have 1 or 2 dimensions "
                         "((Lk) or (B,Lk)), got %d", km->ndim);
    int64_t item = n;
    if (!a.training) {
        a.query += n * Lq * E;
        if (a.key)
            a.key += n * Lk * c->kdim;
        if (a.value)
            a.value += n * Lk * c->vdim;
        /* Checked here over the whole batch, as mha forward does: after
         * the narrowing the library would name item n as item 0. */
        for (int64_t b = 0; a.key_lengths && b < B; b++)
            if (a.key_lengths[b] < 0 || a.key_lengths[b] > Lk)
                return tool_fail("viz", "key_lengths[%lld] = %lld is outside "
                                 "[0, Lk=%lld]", (long long)b,
                                 (long long)a.key_lengths[b], (long long)Lk);
        if (a.key_lengths)
            a.key_lengths += n;
        if (mask_item(a.attn_mask.kind == MHA_MASK_BLOCK ? "block-mask"
                                                         : "attn-mask",
                      &a.attn_mask, 2, B, n) ||
            mask_item("key-mask", &a.key_padding_mask, 1, B, n))
            return 1;
        a.batch = 1;
        item = 0;
    }
    /* The slices: as many rows as slice_bytes() of weights hold, then
     * evened out over the slices. */
    const double row_bytes = (double)a.batch * (double)m->H *
                             (double)m->Lt * sizeof(float);
    const double fit = slice_bytes() / row_bytes;
    int64_t rows = fit < (double)Lq ? (int64_t)fit : Lq;
    rows = rows < 1 ? 1 : rows > Lq ? Lq : rows;
    rows = ceil_div(Lq, ceil_div(Lq, rows));
    int64_t mask_bytes = 0;
    if (a.attn_mask.kind != MHA_MASK_NONE) {
        mask_bytes = a.attn_mask.kind == MHA_MASK_ADDITIVE ? sizeof(float) : 1;
        for (int d = 0; d < a.attn_mask.ndim; d++)
            mask_bytes *= d == a.attn_mask.ndim - 2 ? rows
                                                    : a.attn_mask.shape[d];
    }
    float *w = malloc((size_t)(a.batch * m->H * rows * m->Lt) * sizeof *w);
    float *q = malloc((size_t)(a.batch * rows * E) * sizeof *q);
    float *out = malloc((size_t)(a.batch * rows * E) * sizeof *out);
    double *mean = malloc((size_t)m->Lt * sizeof *mean);
    float *mrow = malloc((size_t)m->Lt * sizeof *mrow);
    void *mbuf = mask_bytes ? malloc((size_t)mask_bytes) : NULL;
    int rc = 0;
    if (!w || !q || !out || !mean || !mrow || (mask_bytes && !mbuf))
        rc = tool_fail("viz", "out of memory for the attention weights of "
                       "%lld query rows (%lld heads x %lld keys)",
                       (long long)rows, (long long)m->H, (long long)m->Lt);
    /* Every slice attends to all the keys: in self-attention the query's
     * rows are the keys. */
    const float *query = a.query;
    const mha_mask full_mask = a.attn_mask;
    if (!a.key) {
        a.key = query;
        a.kv_len = Lk;
    }
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    a.out = out;
    a.query = q;
    a.q_total = Lq;
    for (int64_t i0 = 0; !rc && i0 < Lq; i0 += rows) {
        const int64_t nq = Lq - i0 < rows ? Lq - i0 : rows;
        for (int64_t b = 0; b < a.batch; b++)
            memcpy(q + b * nq * E, query + (b * Lq + i0) * E,
                   (size_t)(nq * E) * sizeof *q);
        if (full_mask.kind != MHA_MASK_NONE)
            mask_rows(&full_mask, Lq, i0, nq, mbuf, &a.attn_mask);
        a.q_len = nq;
        a.q_start = i0;
        if (mha_forward(r->m, &a) != MHA_OK) {
            rc = tool_fail("viz", "%s", mha_last_error());
            break;
        }
        const float *wi = w + item * m->H * nq * m->Lt;
        for (int64_t i = 0; i < nq; i++) {
            for (int64_t j = 0; j < m->Lt; j++)
                mean[j] = 0.0;
            for (int64_t h = 0; h < m->H; h++) {
                const float *row = wi + (h * nq + i) * m->Lt;
                for (int64_t j = 0; j < m->Lt; j++)
                    mean[j] += row[j];
                for (int k = 0; k < np; k++)
                    pool_row(&P[k], m, h, i0 + i, row);
            }
            for (int64_t j = 0; j < m->Lt; j++)
                mrow[j] = (float)(mean[j] / (double)m->H);
            for (int k = 0; k < np; k++)
                pool_row(&P[k], m, m->H, i0 + i, mrow);
        }
    }
    free(w);
    free(q);
    free(out);
    free(mean);
    free(mrow);
    free(mbuf);
    return rc;
}

static float map_max(const float *p, int64_t n)
{
    float mx = 0.0f;
    for (int64_t k = 0; k < n; k++)
        if (p[k] > mx)
            mx = p[k];
    return mx;
}

/* "max-pooled 2 x 3" (blocks of 2 rows x 3 columns per cell), or "". */
static void pool_note(char *buf, size_t n, int64_t fr, int64_t fc)
{
    if (fr > 1 || fc > 1)
        snprintf(buf, n, "max-pooled %lld x %lld", (long long)fr,
                 (long long)fc);
    else
        buf[0] = 0;
}

/* ---- the terminal -------------------------------------------------------- */

/* The terminal's pooling: at most ASCII_CELLS cells per axis. */
static int ascii_pool(pooled *P, const viz_maps *m)
{
    return pooled_init(P, m, ceil_div(m->Lq, ASCII_CELLS),
                       ceil_div(m->Lt, ASCII_CELLS));
}

static int render_ascii(const viz_maps *m, const pooled *P, int64_t item)
{
    const int64_t fr = P->fr, fc = P->fc;
    const int nr = (int)P->nr, nc = (int)P->nc;
    const int np = (int)m->H + 1;
    const float *p = P->p;
    const float **maps = malloc((size_t)np * sizeof *maps);
    char (*titles)[24] = malloc((size_t)np * sizeof *titles);
    const char **tp = malloc((size_t)np * sizeof *tp);
    char rl[ASCII_CELLS], cl[ASCII_CELLS];
    if (!maps || !titles || !tp) {
        free(maps);
        free(titles);
        free(tp);
        return tool_fail("viz", "out of memory for the maps");
    }
    for (int k = 0; k < np; k++) {
        maps[k] = p + (int64_t)k * nr * nc;
        if (k < m->H)
            snprintf(titles[k], sizeof titles[k], "head %d", k);
        else
            snprintf(titles[k], sizeof titles[k], "mean");
        tp[k] = titles[k];
    }
    /* One character per cell: that of its first position. */
    for (int i = 0; i < nr; i++)
        rl[i] = m->row_ch[i * fr];
    for (int j = 0; j < nc; j++)
        cl[j] = m->col_ch[j * fc];
    char note[96];
    pool_note(note, sizeof note, fr, fc);
    printf("batch item %lld: %lld head%s, %lld quer%s (rows) x %lld key%s "
           "(columns)%s%s\n", (long long)item, (long long)m->H,
           m->H == 1 ? "" : "s", (long long)m->Lq, m->Lq == 1 ? "y" : "ies",
           (long long)m->Lt, m->Lt == 1 ? "" : "s", note[0] ? ", " : "",
           note);
    printf("shading of w / (the map's largest w): ' ' < 0.1 <= '░' < 0.25 "
           "<= '▒' < 0.5 <= '▓' < 0.75 <= '█'\n\n");
    /* Panels side by side, as many as $COLUMNS (default 80) allows. */
    const char *env = getenv("COLUMNS");
    const long cols = env ? strtol(env, NULL, 10) : 0;
    const int width = cols >= 20 && cols <= 100000 ? (int)cols : 80;
    const int per = width + 4 >= 2 * nc + 9 ? (width + 4) / (2 * nc + 9) : 1;
    for (int k = 0; k < np; k += per) {
        const int cnt = np - k < per ? np - k : per;
        tool_heatmaps(stdout, maps + k, tp + k, cnt, nr, nc, rl, cl);
        putchar('\n');
    }
    printf("largest w:");
    for (int k = 0; k < np; k++)
        printf(" %s %.4f%s", titles[k],
               (double)map_max(maps[k], (int64_t)nr * nc),
               k + 1 < np ? "," : "\n");
    free(maps);
    free(titles);
    free(tp);
    return 0;
}

/* ---- the image ---------------------------------------------------------- */

typedef struct canvas {
    int w, h;
    unsigned char *px;  /* RGB, row-major */
} canvas;

static const unsigned char INK[3] = {32, 32, 40}, FRAME[3] = {150, 150, 150};

static void fill(canvas *c, int x, int y, int w, int h,
                 const unsigned char rgb[3])
{
    for (int yy = y < 0 ? 0 : y; yy < y + h && yy < c->h; yy++)
        for (int xx = x < 0 ? 0 : x; xx < x + w && xx < c->w; xx++)
            memcpy(c->px + ((size_t)yy * (size_t)c->w + (size_t)xx) * 3, rgb,
                   3);
}

/* Text at scale s: left to right from (x, y) its top left, or, with up,
 * rotated to read upwards from (x, y) its bottom left. */
static void text(canvas *c, int x, int y, const char *s, int sc, int up)
{
    for (int k = 0; s[k]; k++)
        for (int gy = 0; gy < 7; gy++) {
            const unsigned bits = tool_glyph_row((unsigned char)s[k], gy);
            for (int gx = 0; gx < 5; gx++) {
                if (!(bits & (16u >> gx)))
                    continue;
                if (up)
                    fill(c, x + gy * sc, y - (6 * k + gx + 1) * sc, sc, sc,
                         INK);
                else
                    fill(c, x + (6 * k + gx) * sc, y + gy * sc, sc, sc, INK);
            }
        }
}

static int text_w(const char *s, int sc) { return 6 * sc * (int)strlen(s); }

/* Five stops, dark blue to yellow, rising in lightness. */
static void ramp(double t, unsigned char rgb[3])
{
    static const unsigned char stop[5][3] = {
        {34, 18, 70}, {52, 84, 140}, {30, 150, 140}, {110, 200, 90},
        {250, 230, 40}};
    t = t < 0.0 ? 0.0 : t > 1.0 ? 1.0 : t;
    const int k = t >= 1.0 ? 3 : (int)(t * 4.0);
    const double f = t * 4.0 - k;
    for (int ch = 0; ch < 3; ch++)
        rgb[ch] = (unsigned char)lround(stop[k][ch] +
                                        f * (stop[k + 1][ch] - stop[k][ch]));
}

/* An axis's labelled positions (from 1): the multiples of `step`, a round
 * number (1, 2, 5, 10, 20, 50, ...) that keeps labels 12 ls px apart, and
 * position 1 too when it is that far from the first multiple. */
typedef struct ticks {
    int64_t step;
    int one;
} ticks;

static ticks plan_ticks(int64_t f, int cell, int ls)
{
    const int64_t need = (12 * ls + cell - 1) / cell * f;  /* positions */
    ticks t = {1, 1};
    for (int64_t m = 1; t.step < need; m *= 10)
        t.step = need <= m ? m : need <= 2 * m ? 2 * m : need <= 5 * m ? 5 * m
                                                                       : 10 * m;
    t.one = (t.step - 1) / f * cell >= 12 * ls;
    return t;
}

static int is_tick(const ticks *t, int64_t p)
{
    return p % t->step == 0 || (p == 1 && t->one);
}

static int longest_label(const label *lab, int64_t n, const ticks *t)
{
    int mx = 0;
    for (int64_t p = 1; p <= n; p++)
        if (is_tick(t, p) && (int)strlen(lab[p - 1]) > mx)
            mx = (int)strlen(lab[p - 1]);
    return mx;
}

typedef struct layout {
    int64_t fr, fc;
    ticks tr, tc;
    int nr, nc, cell, ls, gc, gr, RW, CH, TH, IW, PW, PH, M, G, CAP, bar_x,
        bar_y, bar_h, tick_w, W, Ht;
    char caption[160], ticks[3][16];
} layout;

/* Cells per axis of a panel (see the top of this file). */
static int png_budget(int64_t H)
{
    const int gc = (int)ceil(sqrt((double)H));
    const int budget = 2304 / (gc + 1);
    return budget < 64 ? 64 : budget > 256 ? 256 : budget;
}

/* The image's pooling. */
static int png_pool(pooled *P, const viz_maps *m)
{
    const int budget = png_budget(m->H);
    return pooled_init(P, m, ceil_div(m->Lq, budget),
                       ceil_div(m->Lt, budget));
}

/* The geometry of the image (see the top of this file). */
static void plan_png(const viz_maps *m, int64_t item, float wmax, layout *L)
{
    memset(L, 0, sizeof *L);
    L->M = 12, L->G = 16, L->CAP = 16, L->TH = 24;
    L->gc = (int)ceil(sqrt((double)m->H));
    L->gr = (int)ceil_div(m->H, L->gc);
    const int budget = png_budget(m->H);
    L->fr = ceil_div(m->Lq, budget);
    L->fc = ceil_div(m->Lt, budget);
    L->nr = (int)ceil_div(m->Lq, L->fr);
    L->nc = (int)ceil_div(m->Lt, L->fc);
    const int big = L->nr > L->nc ? L->nr : L->nc;
    L->cell = budget / big;
    L->cell = L->cell < 1 ? 1 : L->cell > 32 ? 32 : L->cell;
    L->ls = L->cell >= 16 ? 2 : 1;
    L->tr = plan_ticks(L->fr, L->cell, L->ls);
    L->tc = plan_ticks(L->fc, L->cell, L->ls);
    L->RW = 6 * L->ls * longest_label(m->rows, m->Lq, &L->tr) + 4;
    L->CH = 6 * L->ls * longest_label(m->cols, m->Lt, &L->tc) + 4;
    char title[32];   /* the longest: that of the last head */
    snprintf(title, sizeof title, "head %lld", (long long)(m->H - 1));
    L->IW = L->nc * L->cell;
    if (text_w(title, 2) > L->IW)
        L->IW = text_w(title, 2);
    L->PW = L->RW + L->IW;
    L->PH = L->TH + L->CH + L->nr * L->cell;
    const int top = L->M + L->CAP;
    const int mean_x = L->M + L->gc * (L->PW + L->G) + L->G;
    L->bar_x = mean_x + L->PW + L->G;
    L->bar_y = top + L->TH + L->CH;
    L->bar_h = L->nr * L->cell > 64 ? L->nr * L->cell : 64;
    snprintf(L->ticks[0], sizeof L->ticks[0], "%.3g", (double)wmax);
    snprintf(L->ticks[1], sizeof L->ticks[1], "%.3g", (double)wmax / 2);
    snprintf(L->ticks[2], sizeof L->ticks[2], "0");
    for (int k = 0; k < 3; k++)
        if (text_w(L->ticks[k], L->ls) > L->tick_w)
            L->tick_w = text_w(L->ticks[k], L->ls);
    char note[96];
    pool_note(note, sizeof note, L->fr, L->fc);
    snprintf(L->caption, sizeof L->caption,
             "batch item %lld: queries (rows) x keys (columns)%s%s",
             (long long)item, note[0] ? ", " : "", note);
    L->W = L->bar_x + 16 + 4 + L->tick_w + L->M;
    if (2 * L->M + text_w(L->caption, 1) > L->W)
        L->W = 2 * L->M + text_w(L->caption, 1);
    const int grid_bottom = top + L->gr * L->PH + (L->gr - 1) * L->G;
    L->Ht = (grid_bottom > L->bar_y + L->bar_h ? grid_bottom
                                               : L->bar_y + L->bar_h) + L->M;
}

/* One panel: title, labels, frame and cells, at (x, y). */
static void draw_panel(canvas *c, const layout *L, const viz_maps *m,
                       const float *map, float wmax, const char *title, int x,
                       int y)
{
    const int mx = x + L->RW, my = y + L->TH + L->CH;
    const int mw = L->nc * L->cell, mh = L->nr * L->cell;
    text(c, mx + (L->IW - text_w(title, 2)) / 2, y + 4, title, 2, 0);
    const int lh = 7 * L->ls;   /* a glyph's height, or width upright */
    for (int64_t p = 1; p <= m->Lq; p++)   /* in the cell of position p */
        if (is_tick(&L->tr, p))
            text(c, mx - 4 - text_w(m->rows[p - 1], L->ls),
                 my + (int)((p - 1) / L->fr) * L->cell + (L->cell - lh) / 2,
                 m->rows[p - 1], L->ls, 0);
    for (int64_t p = 1; p <= m->Lt; p++)
        if (is_tick(&L->tc, p))
            text(c, mx + (int)((p - 1) / L->fc) * L->cell + (L->cell - lh) / 2,
                 my - 4, m->cols[p - 1], L->ls, 1);
    fill(c, mx - 1, my - 1, mw + 2, mh + 2, FRAME);
    for (int i = 0; i < L->nr; i++)
        for (int j = 0; j < L->nc; j++) {
            unsigned char rgb[3];
            ramp(wmax > 0.0f ? map[i * L->nc + j] / (double)wmax : 0.0, rgb);
            fill(c, mx + j * L->cell, my + i * L->cell, L->cell, L->cell,
                 rgb);
        }
}

static void draw_png(canvas *c, const layout *L, const viz_maps *m,
                     const float *p, float wmax)
{
    memset(c->px, 255, (size_t)c->w * (size_t)c->h * 3);
    text(c, L->M, L->M, L->caption, 1, 0);
    const int top = L->M + L->CAP;
    const size_t plane = (size_t)L->nr * (size_t)L->nc;
    char title[24];
    for (int h = 0; h < m->H; h++) {
        snprintf(title, sizeof title, "head %d", h);
        draw_panel(c, L, m, p + (size_t)h * plane, wmax, title,
                   L->M + (h % L->gc) * (L->PW + L->G),
                   top + (h / L->gc) * (L->PH + L->G));
    }
    draw_panel(c, L, m, p + (size_t)m->H * plane, wmax, "mean",
               L->M + L->gc * (L->PW + L->G) + L->G, top);
    /* The colour bar, max at the top, and its three ticks. */
    text(c, L->bar_x, top + L->TH + L->CH - 8 * L->ls - 4, "w", L->ls, 0);
    fill(c, L->bar_x - 1, L->bar_y - 1, 18, L->bar_h + 2, FRAME);
    for (int yy = 0; yy < L->bar_h; yy++) {
        unsigned char rgb[3];
        ramp(L->bar_h > 1 ? 1.0 - (double)yy / (L->bar_h - 1) : 1.0, rgb);
        fill(c, L->bar_x, L->bar_y + yy, 16, 1, rgb);
    }
    const int th = 7 * L->ls, tx = L->bar_x + 16 + 4;
    text(c, tx, L->bar_y, L->ticks[0], L->ls, 0);
    text(c, tx, L->bar_y + (L->bar_h - th) / 2, L->ticks[1], L->ls, 0);
    text(c, tx, L->bar_y + L->bar_h - th, L->ticks[2], L->ls, 0);
}

#ifdef MHA_HAVE_PNG
static void png_fail(png_structp png, png_const_charp msg)
{
    snprintf((char *)png_get_error_ptr(png), 200, "%s", msg);
    png_longjmp(png, 1);
}

static void png_warn(png_structp png, png_const_charp msg)
{
    (void)png;
    (void)msg;
}

/* The encoded image, grown as libpng writes it. */
typedef struct png_mem {
    unsigned char *data;
    size_t size, cap;
} png_mem;

static void png_mem_write(png_structp png, png_bytep bytes, png_size_t n)
{
    png_mem *m = png_get_io_ptr(png);
    if (n > m->cap - m->size) {
        size_t cap = m->cap ? m->cap : 65536;
        while (cap - m->size < n)
            cap *= 2;
        unsigned char *d = realloc(m->data, cap);
        if (!d)
            png_error(png, "out of memory");
        m->data = d;
        m->cap = cap;
    }
    memcpy(m->data + m->size, bytes, n);
    m->size += n;
}

static void png_mem_flush(png_structp png) { (void)png; }

/* Encodes c into out; 0, or 1 with a message in err (200 bytes). */
static int png_encode(png_mem *out, const canvas *c, png_bytep *rows,
                      char *err)
{
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, err,
                                              png_fail, png_warn);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info) {
        png_destroy_write_struct(&png, NULL);
        snprintf(err, 200, "out of memory");
        return 1;
    }
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_write_struct(&png, &info);
        return 1;
    }
    for (int y = 0; y < c->h; y++)
        rows[y] = c->px + (size_t)y * (size_t)c->w * 3;
    png_set_write_fn(png, out, png_mem_write, png_mem_flush);
    png_set_IHDR(png, info, (png_uint_32)c->w, (png_uint_32)c->h, 8,
                 PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    png_write_image(png, rows);
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    return 0;
}
#endif

/* Encodes the image in memory, then saves it by the library's rules
 * (mha_file_save: a temporary file renamed into place, so that on any
 * failure `path` is as it was; symbolic links followed, FIFOs and devices
 * written through, the old file's mode kept). */
static int write_png(const char *path, const canvas *c)
{
#ifdef MHA_HAVE_PNG
    png_mem img = {0};
    png_bytep *rows = malloc((size_t)c->h * sizeof *rows);
    char err[200] = "out of memory";
    int rc = !rows || png_encode(&img, c, rows, err);
    if (rc)
        tool_fail("viz", "--png: cannot encode the image: %s", err);
    else if (mha_file_save(path, img.data, img.size) != MHA_OK)
        rc = tool_fail("viz", "--png: %s", mha_last_error());
    free(img.data);
    free(rows);
    return rc;
#else
    (void)path;
    (void)c;
    return tool_fail("viz", "--png is not available: this mha was built "
                     "without libpng (install libpng-dev and rebuild); "
                     "--ascii works");
#endif
}

/* Whether path names the file standard output writes to (/dev/stdout,
 * /dev/fd/1, a pipe's or terminal's node, or the very file `> FILE`
 * opened): the image then goes there, and the summary line to stderr. */
static int is_stdout(const char *path)
{
    struct stat a, b;
    return stat(path, &a) == 0 && fstat(STDOUT_FILENO, &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

static int render_png(const char *path, const viz_maps *m, const pooled *P,
                      int64_t item)
{
    layout L;
    const int to_stdout = is_stdout(path);   /* (before a save renames) */
    const float wmax = map_max(P->p, (m->H + 1) * P->nr * P->nc);
    plan_png(m, item, wmax, &L);
    if (L.W > PNG_MAX_SIDE || L.Ht > PNG_MAX_SIDE)
        return tool_fail("viz", "the image would be %d x %d px (%lld heads): "
                         "more than %d px a side; try --ascii", L.W, L.Ht,
                         (long long)m->H, PNG_MAX_SIDE);
    canvas c = {L.W, L.Ht, malloc((size_t)L.W * (size_t)L.Ht * 3)};
    int rc = 0;
    if (!c.px)
        rc = tool_fail("viz", "out of memory for the image");
    if (!rc) {
        draw_png(&c, &L, m, P->p, wmax);
        rc = write_png(path, &c);
    }
    if (!rc)    /* (not into the image when that went to stdout) */
        fprintf(to_stdout ? stderr : stdout,
                "mha viz: wrote %s: %d x %d px, %lld head%s and their mean, "
                "%d x %d cells of %d px%s%s, colour scale 0..%.4g\n", path,
                L.W, L.Ht, (long long)m->H, m->H == 1 ? "" : "s", L.nr,
                L.nc, L.cell, L.fr > 1 || L.fc > 1 ? ", " : "",
                L.fr > 1 || L.fc > 1 ? "max-pooled" : "", (double)wmax);
    free(c.px);
    return rc;
}

/* ---- mha viz ------------------------------------------------------------- */

static const char VIZ_HELP[] =
    "usage: mha viz " RUN_USAGE_INPUTS
    "         [--batch-index N] [--tokens T.txt] [--key-tokens T.txt]\n"
    "         --png HEADS.png | --ascii   (or both)\n"
    "\n"
    "Draws the attention weights of every head (\"head 0\" .. \"head H-1\",\n"
    "numbered from 0 as --head-mask and mha prune --keep count them) and\n"
    "their mean over heads (\"mean\"), rows = queries, columns = keys, for\n"
    "one item of the batch.  The inputs are those of mha forward.\n"
    RUN_HELP_INPUTS
    "  --batch-index N    the item of a batched query to draw (from 0;\n"
    "                     default 0)\n"
    "  --tokens T.txt     labels of the query positions, and of the keys too\n"
    "                     in self-attention: one token per line when the\n"
    "                     file has several lines, else separated by blanks;\n"
    "                     exactly Lq of them.  Without it, positions from 1\n"
    "  --key-tokens T.txt labels of the keys with --key: exactly Lk of them\n"
    "  --png HEADS.png    one image: a panel per head in a grid, the mean\n"
    "                     beside them and a colour bar 0..max shared by all\n"
    "                     panels; labels cut to 6 characters.  At most 256\n"
    "                     cells per axis (fewer with over 8 heads): a longer\n"
    "                     axis is MAX-POOLED, each cell the largest weight of\n"
    "                     its block, so a sharp peak stays visible.  Written\n"
    "                     atomically: on failure no file is left.\n"
    "                     /dev/stdout (a pipe) works: the summary line\n"
    "                     then goes to stderr\n"
    "  --ascii            the same maps on stdout, shaded ' ' < 0.1 <= '░' <\n"
    "                     0.25 <= '▒' < 0.5 <= '▓' < 0.75 <= '█' of each\n"
    "                     map's largest weight (as mha example); at most 64\n"
    "                     cells per axis, max-pooled beyond; one character\n"
    "                     per label (a position's last digit); panels side\n"
    "                     by side up to $COLUMNS (default 80) wide\n"
    "Keys appended by add_bias_kv and add_zero_attn are the last columns\n"
    "(\"bias_k\", \"zero\").  A query row with no key left is all zero.\n"
    "The weights are computed in slices of query rows and max-pooled as\n"
    "they come, so a long sequence needs about 256 MiB of weights at a\n"
    "time (MHA_VIZ_SLICE_BYTES sets another amount), never all of them.\n"
    MOD_NOTE;

int cmd_viz(int argc, char **argv)
{
    tool_opt o[] = {RUN_OPTS, {"batch-index", 1, 0}, {"tokens", 1, 0},
                    {"key-tokens", 1, 0}, {"png", 1, 0}, {"ascii", 0, 0}};
    int status;
    if (tool_options("viz", argc, argv, o, NOPTS(o), VIZ_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    if (!OPT("png") && !OPT("ascii"))
        return tool_fail("viz", "say where to draw: --png FILE and/or "
                         "--ascii (see mha viz --help)");
    if (OPT("png") && !OPT("png")[0])
        return tool_fail("viz", "--png needs a file name");
    static const char *const outs[] = {"png"};
    if (tool_outputs_apart("viz", o, NOPTS(o), outs, 1))
        return 1;
    if (OPT("png") && OPT("ascii") && is_stdout(OPT("png")))
        return tool_fail("viz", "--png %s is standard output, where --ascii "
                         "writes its text: the two would mix; give --png "
                         "another file, or draw one at a time", OPT("png"));
    if (OPT("key-tokens") && !OPT("key"))
        return tool_fail("viz", "--key-tokens needs --key (in self-attention "
                         "--tokens labels both axes)");
#ifndef MHA_HAVE_PNG
    if (OPT("png"))     /* says that this build cannot, before any work */
        return write_png(OPT("png"), NULL);
#endif
    int64_t item = 0;
    if (OPT("batch-index") &&
        tool_int("viz", "batch-index", OPT("batch-index"), 0, INT64_MAX,
                 &item))
        return 1;
    run_setup r;
    if (run_setup_load("viz", o, NOPTS(o), &r))
        return 1;
    /* The labels first: a wrong --tokens file fails before the forward
     * pass, not after it. */
    viz_maps m = {0};
    m.Lq = r.a.q_len;
    m.Lk = r.a.kv_len;
    m.Lt = mha_total_keys(r.m, m.Lk);
    m.H = r.c.num_heads;
    /* The weights are pooled as they are computed, for each drawing. */
    pooled P[2] = {{0}};
    int rc = make_labels(o, NOPTS(o), &r, &m);
    const int ascii = OPT("ascii") != NULL, png = OPT("png") != NULL;
    if (!rc && ascii)
        rc = ascii_pool(&P[0], &m);
    if (!rc && png)
        rc = png_pool(&P[ascii], &m);
    if (!rc)
        rc = item_weights(&r, item, &m, P, ascii + png);
    if (!rc && ascii)
        rc = render_ascii(&m, &P[0], item);
    if (!rc && png)
        rc = render_png(OPT("png"), &m, &P[ascii], item);
#undef OPT
    free(P[0].p);
    free(P[1].p);
    maps_free(&m);
    run_free(&r);
    return rc;
}
