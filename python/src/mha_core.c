/*
 * mha_core.c -- mha._core, the CPython binding of libmha's public C API
 * (include/mha.h, include/mha_io.h).  The Python layer (mha/__init__.py)
 * normalises arguments (dtypes, layouts, defaults); this file checks every
 * buffer it hands to libmha against the size libmha will read or write,
 * so a wrong shape is a Python exception and never a read past a buffer.
 *
 * Buffers come through the buffer protocol, C-contiguous only, never
 * copied: float32 ('f'), bool ('?' or uint8 'B') masks, int64 ('q'/'l')
 * lengths and positions.  The GIL is released around every computation.
 * Every libmha failure raises the exception registered for its status
 * (mha._errors) with mha_last_error()'s message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MHA_EXPERIMENTAL
#include <mha.h>
#include <mha_io.h>

#include <math.h>

/* ---- errors ------------------------------------------------------------ */

/* status -> exception class, filled by _set_errors() from mha._errors. */
#define N_STATUS 13
static PyObject *status_exc[N_STATUS];

static PyObject *raise_status(mha_status st)
{
    const char *msg = mha_last_error();
    PyObject *cls = NULL;
    if ((int)st >= 0 && (int)st < N_STATUS)
        cls = status_exc[st];
    if (!cls)
        cls = PyExc_RuntimeError;
    PyObject *args = Py_BuildValue("(si)", (msg && *msg) ? msg
                                   : mha_status_string(st), (int)st);
    if (args) {
        PyErr_SetObject(cls, args);
        Py_DECREF(args);
    }
    return NULL;
}

static PyObject *set_errors(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyDict_Check(arg))
        return PyErr_Format(PyExc_TypeError, "expected a dict");
    for (int i = 1; i < N_STATUS; i++) {
        PyObject *k = PyLong_FromLong(i);
        PyObject *v = k ? PyDict_GetItemWithError(arg, k) : NULL;
        Py_XDECREF(k);
        if (PyErr_Occurred())
            return NULL;
        Py_XINCREF(v);
        Py_XSETREF(status_exc[i], v);
    }
    Py_RETURN_NONE;
}

/* ---- buffers ----------------------------------------------------------- */

/* The buffers of one call, released together. */
#define MAX_BUFS 32
typedef struct bufset {
    Py_buffer v[MAX_BUFS];
    int n;
} bufset;

static void bufs_release(bufset *b)
{
    for (int i = 0; i < b->n; i++)
        PyBuffer_Release(&b->v[i]);
    b->n = 0;
}

enum { T_F32 = 'f', T_BOOL = 'b', T_I64 = 'q', T_U16 = 'H' };

static const char *type_name(int t)
{
    return t == T_F32 ? "float32" : t == T_BOOL ? "bool (or uint8)"
         : t == T_U16 ? "16-bit (int16, uint16 or float16)" : "int64";
}

static int format_ok(const Py_buffer *v, int t)
{
    const char *f = v->format ? v->format : "B";
    while (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (f[0] == '\0' || f[1] != '\0')
        return 0;
    switch (t) {
    case T_F32: return f[0] == 'f' && v->itemsize == 4;
    case T_BOOL: return (f[0] == '?' || f[0] == 'B') && v->itemsize == 1;
    case T_I64: return (f[0] == 'q' || f[0] == 'l') && v->itemsize == 8;
    case T_U16:   /* the bits of a bf16 or f16 element */
        return (f[0] == 'h' || f[0] == 'H' || f[0] == 'e') && v->itemsize == 2;
    }
    return 0;
}

/*
 * Gets the buffer of `o` (None -> *ptr = NULL, unless required) as a
 * C-contiguous array of type t with exactly `numel` elements (numel < 0:
 * any).  Returns 0 or -1 with an exception set.
 */
static int get_buf(bufset *b, PyObject *o, const char *name, int t,
                   int writable, int64_t numel, int required, void **ptr,
                   Py_buffer **view)
{
    *ptr = NULL;
    if (view)
        *view = NULL;
    if (o == NULL || o == Py_None) {
        if (required) {
            PyErr_Format(PyExc_TypeError, "%s is required, got None", name);
            return -1;
        }
        return 0;
    }
    if (b->n >= MAX_BUFS) {
        PyErr_SetString(PyExc_RuntimeError, "too many buffers in one call");
        return -1;
    }
    Py_buffer *v = &b->v[b->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                (writable ? PyBUF_WRITABLE : 0);
    if (!PyObject_CheckBuffer(o)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a contiguous %s array (a buffer), not %s",
                     name, type_name(t), Py_TYPE(o)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(o, v, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s %s array",
                     name, writable ? ", writable" : "", type_name(t));
        return -1;
    }
    b->n++;
    if (!format_ok(v, t)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype %s, got format '%s'",
                     name, type_name(t), v->format ? v->format : "B");
        return -1;
    }
    int64_t have = (int64_t)(v->len / v->itemsize);
    if (numel >= 0 && have != numel) {
        PyErr_Format(PyExc_ValueError,
                     "%s has %lld elements, expected %lld", name,
                     (long long)have, (long long)numel);
        return -1;
    }
    *ptr = v->buf;
    if (view)
        *view = v;
    return 0;
}

/* A mask: (kind, buffer) with the buffer's own shape (1 to 4 dims). */
static int get_mask(bufset *b, PyObject *o, int kind, const char *name,
                    mha_mask *m)
{
    memset(m, 0, sizeof *m);
    if (o == NULL || o == Py_None || kind == MHA_MASK_NONE)
        return 0;
    if (kind < MHA_MASK_ALLOW || kind > MHA_MASK_ADDITIVE) {
        PyErr_Format(PyExc_ValueError, "%s: unknown mask kind %d", name, kind);
        return -1;
    }
    void *p;
    Py_buffer *v;
    if (get_buf(b, o, name, kind == MHA_MASK_ADDITIVE ? T_F32 : T_BOOL, 0, -1,
                1, &p, &v))
        return -1;
    if (v->ndim < 1 || v->ndim > 4) {
        PyErr_Format(PyExc_ValueError, "%s must have 1 to 4 dimensions, got %d",
                     name, v->ndim);
        return -1;
    }
    m->kind = (mha_mask_kind)kind;
    m->data = p;
    m->ndim = v->ndim;
    for (int i = 0; i < v->ndim; i++)
        m->shape[i] = v->shape[i];
    return 0;
}

/* Modifiers: None or a tuple (softcap, alibi, slopes|None, window, left,
 * right, rope_style, rope_dims, rope_theta, rope_scale, attention_chunk);
 * the chunk goes to *chunk (a field beside mha_modifiers in C). */
static int get_mods(bufset *b, PyObject *o, int64_t heads, mha_modifiers *m,
                    int64_t *chunk)
{
    memset(m, 0, sizeof *m);
    *chunk = 0;
    if (o == NULL || o == Py_None)
        return 0;
    PyObject *slopes = Py_None;
    int rope_style = 0;
    long long ch = 0;
    if (!PyArg_ParseTuple(o, "fiOiLLiLffL;modifiers", &m->softcap, &m->alibi,
                          &slopes, &m->window, &m->window_left,
                          &m->window_right, &rope_style, &m->rope.dims,
                          &m->rope.theta, &m->rope.scale, &ch))
        return -1;
    *chunk = ch;
    m->rope.style = (mha_rope_style)rope_style;
    void *p;
    if (get_buf(b, slopes, "alibi_slopes", T_F32, 0, heads, 0, &p, NULL))
        return -1;
    m->alibi_slopes = p;
    return 0;
}

/* a * b * c, or -2 (matching no buffer) when it overflows */
static int64_t mul3(int64_t a, int64_t b, int64_t c)
{
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r) || __builtin_mul_overflow(r, c, &r))
        return -2;
    return r;
}

/* ---- the module -------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    mha_module *m;
    mha_config cfg;  /* resolved (alibi_slopes points into the module) */
    int busy;        /* forwards in flight (the GIL guards it) */
    /* The last forward's plan (mha_plan_create), kept for the next call of
     * the same shape so that a forward allocates nothing, as `mha bench`
     * times it; used by one call at a time (others fall back to
     * mha_forward), replaced when the shape changes. */
    mha_plan *plan;
    int64_t plan_key[6];  /* B, Lq, Lk, num_threads, cache capacity, dtype */
    int plan_busy;
    /* mha.nn's torch parameters (module_watch), checked by forward_fast:
     * a weak reference to the nn module, the (sub, name) paths, and per
     * parameter the data pointer and version it must have. */
    PyObject *w_owner, *w_paths;
    int64_t *w_state;
} ModuleObject;

typedef struct {
    PyObject_HEAD
    mha_kv_cache *c;
    mha_kv_cache_config cfg;
    int busy;
} CacheObject;

static PyTypeObject ModuleType;
static PyTypeObject CacheType;

static void module_dealloc(ModuleObject *self)
{
    mha_plan_free(self->plan);
    mha_free(self->m);
    Py_XDECREF(self->w_owner);
    Py_XDECREF(self->w_paths);
    PyMem_Free(self->w_state);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *wrap_module(mha_module *m)
{
    ModuleObject *o = PyObject_New(ModuleObject, &ModuleType);
    if (!o) {
        mha_free(m);
        return NULL;
    }
    o->m = m;
    o->busy = 0;
    o->plan = NULL;
    o->plan_busy = 0;
    o->w_owner = o->w_paths = NULL;
    o->w_state = NULL;
    if (mha_get_config(m, &o->cfg) != MHA_OK) {
        raise_status(MHA_ERR_INVALID_ARGUMENT);
        Py_DECREF(o);
        return NULL;
    }
    return (PyObject *)o;
}

/* Config keywords shared by module_create and module_load's base. */
static char *cfg_kw[] = {
    "embed_dim", "num_heads", "kdim", "vdim", "bias", "add_bias_kv",
    "add_zero_attn", "dropout", "scale", "seed", "num_kv_heads", "head_dim",
    "sinks", "modifiers", "path", "v_head_dim", NULL};

static int parse_cfg(PyObject *args, PyObject *kw, mha_config *c,
                     bufset *b, const char **path)
{
    memset(c, 0, sizeof *c);
    int bias = 1, add_bias_kv = 0, add_zero_attn = 0, sinks = 0;
    PyObject *scale = Py_None, *dropout = Py_None, *mods = Py_None;
    unsigned long long seed = 0;
    *path = NULL;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "|LLLLpppOOKLLpOzL", cfg_kw, &c->embed_dim,
            &c->num_heads, &c->kdim, &c->vdim, &bias, &add_bias_kv,
            &add_zero_attn, &dropout, &scale, &seed, &c->num_kv_heads,
            &c->head_dim, &sinks, &mods, path, &c->v_head_dim))
        return -1;
    c->no_bias = !bias;
    c->add_bias_kv = add_bias_kv;
    c->add_zero_attn = add_zero_attn;
    c->sinks = sinks;
    c->seed = seed;
    if (dropout != Py_None) {
        c->dropout = (float)PyFloat_AsDouble(dropout);
        if (PyErr_Occurred())
            return -1;
        c->given |= MHA_GIVEN_DROPOUT;
    }
    if (scale != Py_None) {
        c->scale = (float)PyFloat_AsDouble(scale);
        if (PyErr_Occurred())
            return -1;
        c->given |= MHA_GIVEN_SCALE;
    }
    return get_mods(b, mods, c->num_heads, &c->mods, &c->attention_chunk);
}

static PyObject *module_create(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    mha_config c;
    bufset b = {.n = 0};
    const char *path;
    if (parse_cfg(args, kw, &c, &b, &path)) {
        bufs_release(&b);
        return NULL;
    }
    mha_module *m = NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_create(&c, &m);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    return wrap_module(m);
}

/* module_load(path=..., num_heads=0, <config overrides as base>) */
static PyObject *module_load(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    mha_config c;
    bufset b = {.n = 0};
    const char *path;
    if (parse_cfg(args, kw, &c, &b, &path)) {
        bufs_release(&b);
        return NULL;
    }
    if (!path) {
        bufs_release(&b);
        return PyErr_Format(PyExc_TypeError, "path is required");
    }
    int64_t heads = c.num_heads;
    mha_config base = c;
    base.num_heads = 0;
    /* A base field of zero keeps the file's value; dropout given as 0
     * overrides the file's (MHA_GIVEN_DROPOUT). */
    mha_tensor_file *f = NULL;
    mha_module *m = NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_safetensors_load(path, &f);
    if (st == MHA_OK)
        st = mha_module_from_file(f, heads, &base, &m);
    mha_tensor_file_free(f);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    return wrap_module(m);
}

static PyObject *module_save(ModuleObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_module_save(self->m, path);
    Py_END_ALLOW_THREADS
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *mods_to_dict(const mha_modifiers *m, int64_t heads)
{
    PyObject *slopes = Py_None;
    Py_INCREF(Py_None);
    if (m->alibi_slopes) {
        Py_DECREF(Py_None);
        slopes = PyList_New(heads);
        if (!slopes)
            return NULL;
        for (int64_t h = 0; h < heads; h++)
            PyList_SET_ITEM(slopes, h, PyFloat_FromDouble(m->alibi_slopes[h]));
    }
    return Py_BuildValue(
        "{sdsisNsisLsLsisLsdsd}", "softcap", (double)m->softcap, "alibi",
        m->alibi, "alibi_slopes", slopes, "window", m->window, "window_left",
        (long long)m->window_left, "window_right", (long long)m->window_right,
        "rope_style", (int)m->rope.style, "rope_dims", (long long)m->rope.dims,
        "rope_theta", (double)m->rope.theta, "rope_scale",
        (double)m->rope.scale);
}

static PyObject *module_config(ModuleObject *self, PyObject *unused)
{
    (void)unused;
    const mha_config *c = &self->cfg;
    PyObject *mods = mods_to_dict(&c->mods, c->num_heads);
    if (!mods)
        return NULL;
    return Py_BuildValue(
        "{sLsLsLsLsOsOsOsdsdsKsLsLsOsNsLsL}", "embed_dim", (long long)c->embed_dim,
        "num_heads", (long long)c->num_heads, "kdim", (long long)c->kdim,
        "vdim", (long long)c->vdim, "bias", c->no_bias ? Py_False : Py_True,
        "add_bias_kv", c->add_bias_kv ? Py_True : Py_False, "add_zero_attn",
        c->add_zero_attn ? Py_True : Py_False, "dropout", (double)c->dropout,
        "scale", (double)c->scale, "seed", (unsigned long long)c->seed,
        "num_kv_heads", (long long)c->num_kv_heads, "head_dim",
        (long long)c->head_dim, "sinks", c->sinks ? Py_True : Py_False,
        "modifiers", mods, "attention_chunk", (long long)c->attention_chunk,
        "v_head_dim", (long long)c->v_head_dim);
}

/* [(name, shape tuple, numel, offset), ...] in PyTorch's state_dict order */
static PyObject *module_params(ModuleObject *self, PyObject *unused)
{
    (void)unused;
    int n = mha_param_count(self->m);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (int i = 0; i < n; i++) {
        mha_param_info info;
        if (mha_param_info_at(self->m, i, &info) != MHA_OK) {
            Py_DECREF(list);
            return raise_status(MHA_ERR_INVALID_ARGUMENT);
        }
        PyObject *shape = PyTuple_New(info.ndim);
        if (!shape) {
            Py_DECREF(list);
            return NULL;
        }
        for (int d = 0; d < info.ndim; d++)
            PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(info.shape[d]));
        PyList_SET_ITEM(list, i,
                        Py_BuildValue("(sNLL)", info.name, shape,
                                      (long long)info.numel,
                                      (long long)info.offset));
    }
    return list;
}

static PyObject *module_param_numel(ModuleObject *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLongLong(mha_param_numel(self->m));
}

static int param_numel_of(ModuleObject *self, const char *name, int64_t *n)
{
    mha_param_info info;
    mha_status st = mha_param_info_by_name(self->m, name, &info);
    if (st != MHA_OK) {
        raise_status(st);
        return -1;
    }
    *n = info.numel;
    return 0;
}

/* param_get(name, out): copies the parameter into the float32 buffer out */
static PyObject *module_param_get(ModuleObject *self, PyObject *args)
{
    const char *name;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "sO", &name, &out))
        return NULL;
    int64_t n;
    if (param_numel_of(self, name, &n))
        return NULL;
    bufset b = {.n = 0};
    void *p;
    if (get_buf(&b, out, "out", T_F32, 1, n, 1, &p, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st = mha_param_get(self->m, name, p, n);
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *module_param_set(ModuleObject *self, PyObject *args)
{
    const char *name;
    PyObject *src;
    if (!PyArg_ParseTuple(args, "sO", &name, &src))
        return NULL;
    if (self->busy)
        return PyErr_Format(PyExc_RuntimeError,
                            "the module's parameters cannot change while "
                            "another thread runs it");
    int64_t n;
    if (param_numel_of(self, name, &n))
        return NULL;
    bufset b = {.n = 0};
    void *p;
    if (get_buf(&b, src, name, T_F32, 0, n, 1, &p, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st = mha_param_set(self->m, name, p, n);
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *module_reset_parameters(ModuleObject *self, PyObject *args)
{
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "K", &seed))
        return NULL;
    if (self->busy)
        return PyErr_Format(PyExc_RuntimeError,
                            "the module's parameters cannot change while "
                            "another thread runs it");
    mha_status st = mha_reset_parameters(self->m, seed);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *module_total_keys(ModuleObject *self, PyObject *args)
{
    long long kv;
    if (!PyArg_ParseTuple(args, "L", &kv))
        return NULL;
    return PyLong_FromLongLong(mha_total_keys(self->m, kv));
}

/* prune_heads(keep): a new module of the heads keep (a sequence of
 * distinct ints in [0, H)), mha_prune_heads. */
static PyObject *module_prune_heads(ModuleObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "keep must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *keep = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *keep);
    if (!keep) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long h = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (h == -1 && PyErr_Occurred()) {
            PyMem_Free(keep);
            Py_DECREF(seq);
            return NULL;
        }
        keep[i] = h;
    }
    Py_DECREF(seq);
    mha_module *m = NULL;
    mha_status st = mha_prune_heads(self->m, keep, (int64_t)n, &m);
    PyMem_Free(keep);
    if (st != MHA_OK)
        return raise_status(st);
    return wrap_module(m);
}

/* check_finite(): raises mha.NonFiniteError naming the first parameter
 * element that is NaN or infinite (what mha_param_set refuses), for
 * parameters written in place through the buffer (mha_param_data). */
static PyObject *module_check_finite(ModuleObject *self, PyObject *unused)
{
    (void)unused;
    const float *d = mha_param_data(self->m);
    for (int i = 0; d && i < mha_param_count(self->m); i++) {
        mha_param_info info;
        if (mha_param_info_at(self->m, i, &info) != MHA_OK)
            return raise_status(MHA_ERR_INVALID_ARGUMENT);
        const float *p = d + info.offset;
        for (int64_t k = 0; k < info.numel; k++) {
            if (isfinite(p[k]))
                continue;
            char msg[160];
            PyOS_snprintf(msg, sizeof msg, "parameter %s: element %lld is %g",
                          info.name, (long long)k, (double)p[k]);
            PyObject *cls = status_exc[MHA_ERR_NON_FINITE];
            PyObject *args = Py_BuildValue("(si)", msg,
                                           (int)MHA_ERR_NON_FINITE);
            if (args) {
                PyErr_SetObject(cls ? cls : PyExc_ValueError, args);
                Py_DECREF(args);
            }
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *module_project(ModuleObject *self, PyObject *args)
{
    int which;
    PyObject *x, *y;
    long long rows;
    if (!PyArg_ParseTuple(args, "iOLO", &which, &x, &rows, &y))
        return NULL;
    const mha_config *c = &self->cfg;
    int64_t hkv = c->num_kv_heads, D = c->num_heads * c->head_dim;
    int64_t in, outw;
    switch (which) {
    case MHA_PROJ_QUERY: in = c->embed_dim; outw = D; break;
    case MHA_PROJ_KEY: in = c->kdim; outw = hkv * c->head_dim; break;
    case MHA_PROJ_VALUE: in = c->vdim; outw = hkv * c->v_head_dim; break;
    case MHA_PROJ_OUT: in = c->num_heads * c->v_head_dim;
        outw = c->embed_dim; break;
    default: return PyErr_Format(PyExc_ValueError, "unknown projection %d",
                                 which);
    }
    if (rows < 0)
        return PyErr_Format(PyExc_ValueError, "rows must be >= 0");
    bufset b = {.n = 0};
    void *px, *py;
    if (get_buf(&b, x, "x", T_F32, 0, mul3(rows, in, 1), 1, &px, NULL) ||
        get_buf(&b, y, "y", T_F32, 1, mul3(rows, outw, 1), 1, &py, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_project(self->m, (mha_projection)which, px, rows, py);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static int64_t cache_max_len(const mha_kv_cache_config *cc,
                             const mha_kv_cache *c)
{
    int64_t mx = 0;
    for (int64_t s = 0; s < cc->batch; s++) {
        int64_t l = mha_kv_cache_length(c, s);
        if (l > mx)
            mx = l;
    }
    return mx;
}


/*
 * forward(...) and, with grad_out, backward(...): one argument list, the
 * fields of mha_forward_args and mha_backward_args.
 */
static mha_status forward_kept(ModuleObject *self, mha_forward_args *a,
                               CacheObject *co);

static PyObject *module_run(ModuleObject *self, PyObject *args, PyObject *kw)
{
    static char *kws[] = {
        "query", "key", "value", "out", "batch", "q_len", "kv_len",
        "attn_mask", "attn_mask_kind", "key_padding_mask",
        "key_padding_mask_kind", "key_lengths", "causal", "need_weights",
        "attn_weights", "num_threads", "training", "dropout_seed",
        "head_mask", "cache", "positions", "grad_out", "grad_query",
        "grad_key", "grad_value", "grad_params", "accumulate",
        "grad_head_mask", "dtype", NULL};
    PyObject *q = Py_None, *k = Py_None, *v = Py_None, *out = Py_None;
    PyObject *am = Py_None, *kpm = Py_None, *kl = Py_None, *w = Py_None;
    PyObject *hm = Py_None, *cache = Py_None, *pos = Py_None;
    PyObject *go = Py_None, *gq = Py_None, *gk = Py_None, *gv = Py_None;
    PyObject *gp = Py_None, *ghm = Py_None;
    long long B = 0, Lq = 0, Lk = 0;
    int amk = 0, kpmk = 0, causal = 0, nw = 0, threads = 0, training = 0;
    int accumulate = 0, dtype = MHA_DTYPE_F32;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "OOOOLL|LOiOiOiiOipKOOOOOOOOpOi", kws, &q, &k, &v, &out,
            &B, &Lq, &Lk, &am, &amk, &kpm, &kpmk, &kl, &causal, &nw, &w,
            &threads, &training, &seed, &hm, &cache, &pos, &go, &gq, &gk, &gv,
            &gp, &accumulate, &ghm, &dtype))
        return NULL;
    /* dtype BF16 / F16: query, key, value and out hold 16-bit patterns,
     * and so do grad_out, grad_query, grad_key and grad_value (grad_params
     * stays float32); the library refuses what a 16-bit call does not
     * take */
    const int td = dtype == MHA_DTYPE_F32 ? T_F32 : T_U16;
    const mha_config *c = &self->cfg;
    if (B < 1 || Lq < 1 || Lk < 0)
        return PyErr_Format(PyExc_ValueError,
                            "batch and q_len must be >= 1, kv_len >= 0");
    CacheObject *co = NULL;
    if (cache != Py_None) {
        if (!PyObject_TypeCheck(cache, &CacheType))
            return PyErr_Format(PyExc_TypeError, "cache must be a KVCache");
        co = (CacheObject *)cache;
        if (co->busy)
            return PyErr_Format(PyExc_RuntimeError,
                                "the KV cache is in use by another thread");
    }
    int backward = go != Py_None;
    int64_t E = c->embed_dim, H = c->num_heads;
    /* the resolved Lk: of the inputs, or of the cache after the append */
    int64_t lk = Lk ? Lk : Lq;
    if (co && !Lk)
        lk = cache_max_len(&co->cfg, co->c) + Lq;
    int64_t lkt = mha_total_keys(self->m, lk);
    int64_t wn = nw == MHA_WEIGHTS_AVERAGE ? mul3(B, Lq, lkt)
               : nw == MHA_WEIGHTS_PER_HEAD ? mul3(mul3(B, H, Lq), lkt, 1) : 0;
    int kv_in = co == NULL;  /* key/value inputs exist */

    mha_forward_args a;
    memset(&a, 0, sizeof a);
    bufset b = {.n = 0};
    void *pq, *pk, *pv, *pout, *pw, *pkl, *phm, *ppos;
    void *pgo, *pgq, *pgk, *pgv, *pgp, *pghm;
    if (get_buf(&b, q, "query", td, 0, mul3(B, Lq, E), 1, &pq, NULL) ||
        get_buf(&b, k, "key", td, 0, mul3(B, lk, c->kdim), 0, &pk, NULL) ||
        get_buf(&b, v, "value", td, 0,
                mul3(B, lk, pk ? c->vdim : c->kdim), 0, &pv, NULL) ||
        get_buf(&b, out, "out", td, 1, mul3(B, Lq, E), !backward, &pout,
                NULL) ||
        get_buf(&b, w, "attn_weights", T_F32, 1, wn, nw != 0 && !backward,
                &pw, NULL) ||
        get_buf(&b, kl, "key_lengths", T_I64, 0, B, 0, &pkl, NULL) ||
        get_buf(&b, hm, "head_mask", T_F32, 0, H, 0, &phm, NULL) ||
        get_buf(&b, pos, "positions", T_I64, 0, mul3(B, Lq, 1), 0, &ppos, NULL) ||
        get_mask(&b, am, amk, "attn_mask", &a.attn_mask) ||
        get_mask(&b, kpm, kpmk, "key_padding_mask", &a.key_padding_mask))
        goto fail;
    if (pv && !pk) {
        PyErr_SetString(PyExc_ValueError, "value given without key");
        goto fail;
    }
    (void)kv_in;
    if (co && !backward && (pk || pv || training ||
                            causal == MHA_CAUSAL_TOP_LEFT || Lk)) {
        bufs_release(&b);
        return raise_status(mha_error_set(
            MHA_ERR_INVALID_ARGUMENT,
            pk || pv ? "with a KV cache, key and value must be unset: the "
                       "keys are the cache's and the new tokens'"
            : training ? "with a KV cache, training must be unset: a "
                         "decoding step has no backward"
            : Lk ? "with a KV cache, kv_len must be unset: the cache's "
                   "lengths give it"
                 : "with a KV cache, causal masking is bottom-right "
                   "(each new token sees its sequence's past): top-left is "
                   "refused"));
    }
    a.batch = B;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.query = pq;
    a.key = pk;
    a.value = pv;
    a.key_lengths = pkl;
    a.causal = (mha_causal)causal;
    a.need_weights = (mha_weights_mode)nw;
    a.attn_weights = pw;
    a.num_threads = threads;
    a.training = training;
    a.dropout_seed = seed;
    a.head_mask = phm;
    a.out = pout;
    a.cache = co ? co->c : NULL;
    a.positions = ppos;
    if (dtype != MHA_DTYPE_F32) {
        a.dtype = (mha_dtype)dtype;
        a.query16 = pq;
        a.key16 = pk;
        a.value16 = pv;
        a.out16 = pout;
        a.query = a.key = a.value = a.out = NULL;
    }

    mha_backward_args ba;
    memset(&ba, 0, sizeof ba);
    if (backward) {
        if (get_buf(&b, go, "grad_out", td, 0, mul3(B, Lq, E), 1, &pgo,
                    NULL) ||
            get_buf(&b, gq, "grad_query", td, 1, mul3(B, Lq, E), 0, &pgq,
                    NULL) ||
            get_buf(&b, gk, "grad_key", td, 1, mul3(B, lk, c->kdim), 0,
                    &pgk, NULL) ||
            get_buf(&b, gv, "grad_value", td, 1, mul3(B, lk, c->vdim), 0,
                    &pgv, NULL) ||
            get_buf(&b, gp, "grad_params", T_F32, 1,
                    mha_param_numel(self->m), 0, &pgp, NULL) ||
            get_buf(&b, ghm, "grad_head_mask", T_F32, 1, H, 0, &pghm, NULL))
            goto fail;
        ba.grad_out = pgo;
        ba.grad_query = pgq;
        ba.grad_key = pgk;
        ba.grad_value = pgv;
        ba.grad_params = pgp;
        ba.accumulate = accumulate;
        ba.grad_head_mask = pghm;
        if (dtype != MHA_DTYPE_F32) {
            ba.grad_out16 = pgo;
            ba.grad_query16 = pgq;
            ba.grad_key16 = pgk;
            ba.grad_value16 = pgv;
            ba.grad_out = ba.grad_query = ba.grad_key = ba.grad_value = NULL;
        }
        a.need_weights = MHA_WEIGHTS_NONE;
        a.attn_weights = NULL;
    }

    mha_status st;
    if (backward) {
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        st = mha_backward(self->m, &a, &ba);
        Py_END_ALLOW_THREADS
        self->busy--;
    } else {
        st = forward_kept(self, &a, co);
    }
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
fail:
    bufs_release(&b);
    return NULL;
}

/*
 * A forward on the module's kept plan when no other call holds it (made,
 * or remade for this shape, first), else mha_forward; the GIL released.
 */
static mha_status forward_kept(ModuleObject *self, mha_forward_args *a,
                               CacheObject *co)
{
    /* With a cache the call is a decode step: its own entry points, with
     * what that mode reads (the caller refused key, value and training). */
    mha_decode_args d;
    memset(&d, 0, sizeof d);
    d.batch = a->batch;
    d.q_len = a->q_len;
    d.query = a->query;
    d.out = a->out;
    d.cache = a->cache;
    d.attn_mask = a->attn_mask;
    d.key_padding_mask = a->key_padding_mask;
    d.key_lengths = a->key_lengths;
    d.need_weights = a->need_weights;
    d.attn_weights = a->attn_weights;
    d.positions = a->positions;
    d.head_mask = a->head_mask;
    d.num_threads = a->num_threads;
    mha_plan *plan = NULL;
    if (!self->plan_busy) {
        int64_t key[6] = {a->batch, a->q_len, a->kv_len, a->num_threads,
                          co ? co->cfg.capacity : 0, a->dtype};
        if (!self->plan || memcmp(key, self->plan_key, sizeof key)) {
            mha_plan_free(self->plan);
            self->plan = NULL;
            if ((co ? mha_plan_create_decode(self->m, &d, &self->plan)
                    : mha_plan_create(self->m, a, &self->plan)) == MHA_OK)
                memcpy(self->plan_key, key, sizeof key);
            else
                self->plan = NULL;  /* the unplanned call reports it */
        }
        plan = self->plan;
    }
    mha_status st;
    self->busy++;
    if (co)
        co->busy = 1;
    if (plan)
        self->plan_busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (co)
        st = plan ? mha_plan_decode(plan, &d) : mha_decode(self->m, &d);
    else
        st = plan ? mha_plan_forward(plan, a) : mha_forward(self->m, a);
    Py_END_ALLOW_THREADS
    if (plan)
        self->plan_busy = 0;
    self->busy--;
    if (co)
        co->busy = 0;
    return st;
}

/*
 * A buffer of `o` for forward_fast: a C-contiguous float32 array of 3
 * dimensions, the last `width`; 0 with *ptr = NULL for None, 1 when `o`
 * is anything else (no exception: the full path says what is wrong).
 */
static int fast_buf(bufset *b, PyObject *o, int64_t width, int writable,
                    void **ptr, const Py_ssize_t **shape)
{
    *ptr = NULL;
    if (o == Py_None)
        return 0;
    Py_buffer *v = &b->v[b->n];
    if (!PyObject_CheckBuffer(o) ||
        PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                     (writable ? PyBUF_WRITABLE : 0))) {
        PyErr_Clear();
        return 1;
    }
    b->n++;
    if (!format_ok(v, T_F32) || v->ndim != 3 || v->shape[2] != width ||
        v->shape[0] < 1 || v->shape[1] < 1)
        return 1;
    *ptr = v->buf;
    *shape = v->shape;
    return 0;
}

/*
 * Whether the watched torch parameters (watch()) are all still the views
 * of this module's memory that mha.nn linked, none changed in place since
 * the last check: 1 yes (or nothing watched), 0 no, -1 error.
 */
static int watch_ok(ModuleObject *self)
{
    static PyObject *s_params, *s_modules, *s_data_ptr, *s_version;
    if (!self->w_paths)
        return 1;
    if (!s_params && (!(s_params = PyUnicode_InternFromString("_parameters")) ||
                      !(s_modules = PyUnicode_InternFromString("_modules")) ||
                      !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
                      !(s_version = PyUnicode_InternFromString("_version"))))
        return -1;
    PyObject *owner = PyWeakref_GetObject(self->w_owner);  /* borrowed */
    if (!owner)
        return -1;
    if (owner == Py_None)
        return 0;
    Py_INCREF(owner);
    int ok = 1;
    const Py_ssize_t n = PyTuple_GET_SIZE(self->w_paths);
    for (Py_ssize_t i = 0; ok == 1 && i < n; i++) {
        PyObject *path = PyTuple_GET_ITEM(self->w_paths, i);
        PyObject *sub = PyTuple_GET_ITEM(path, 0);
        PyObject *name = PyTuple_GET_ITEM(path, 1);
        PyObject *mod = owner, *mods = NULL, *dict = NULL, *p = NULL;
        if (sub != Py_None) {             /* a submodule's: out_proj.weight */
            mods = PyObject_GetAttr(owner, s_modules);
            mod = mods && PyDict_Check(mods)       /* borrowed from mods */
                      ? PyDict_GetItemWithError(mods, sub) : NULL;
        }
        dict = mod ? PyObject_GetAttr(mod, s_params) : NULL;
        Py_XDECREF(mods);
        if (dict && PyDict_Check(dict)) {
            p = PyDict_GetItemWithError(dict, name);
            Py_XINCREF(p);
        }
        Py_XDECREF(dict);
        if (!p || p == Py_None) {
            ok = PyErr_Occurred() ? -1 : 0;
            if (ok < 0 && PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                ok = 0;
            }
            Py_XDECREF(p);
            break;
        }
        PyObject *ptr = PyObject_CallMethodNoArgs(p, s_data_ptr);
        PyObject *ver = ptr ? PyObject_GetAttr(p, s_version) : NULL;
        Py_DECREF(p);
        long long vp = ptr ? PyLong_AsLongLong(ptr) : -1;
        long long vv = ver ? PyLong_AsLongLong(ver) : -1;
        Py_XDECREF(ptr);
        Py_XDECREF(ver);
        if (PyErr_Occurred())
            ok = -1;
        else if (vp != self->w_state[2 * i] || vv != self->w_state[2 * i + 1])
            ok = 0;
    }
    Py_DECREF(owner);
    return ok;
}

/*
 * watch(owner, paths, data_ptrs, versions): mha.nn's parameters, found as
 * owner._parameters[name], or owner._modules[sub]._parameters[name], for
 * each (sub or None, name) of paths, with the data pointers and version
 * counters they must still have for forward_fast to run (the owner held
 * by a weak reference: its parameters view this module's memory, so a
 * strong one would be a cycle the collector cannot see); watch(None)
 * stops watching.
 */
static PyObject *module_watch(ModuleObject *self, PyObject *args)
{
    PyObject *owner = Py_None, *paths = Py_None;
    PyObject *ptrs = Py_None, *vers = Py_None;
    if (!PyArg_ParseTuple(args, "O|OOO", &owner, &paths, &ptrs, &vers))
        return NULL;
    Py_CLEAR(self->w_owner);
    Py_CLEAR(self->w_paths);
    PyMem_Free(self->w_state);
    self->w_state = NULL;
    if (owner == Py_None)
        Py_RETURN_NONE;
    if (!PyTuple_Check(paths) || !PyTuple_Check(ptrs) || !PyTuple_Check(vers))
        return PyErr_Format(PyExc_TypeError, "watch(owner, tuple, tuple, "
                            "tuple)");
    const Py_ssize_t n = PyTuple_GET_SIZE(paths);
    if (PyTuple_GET_SIZE(ptrs) != n || PyTuple_GET_SIZE(vers) != n)
        return PyErr_Format(PyExc_ValueError, "watch: %zd paths but %zd "
                            "pointers and %zd versions", n,
                            PyTuple_GET_SIZE(ptrs), PyTuple_GET_SIZE(vers));
    int64_t *st = PyMem_Calloc((size_t)n + 1, 2 * sizeof *st);
    if (!st)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *path = PyTuple_GET_ITEM(paths, i);
        if (!PyTuple_Check(path) || PyTuple_GET_SIZE(path) != 2) {
            PyMem_Free(st);
            return PyErr_Format(PyExc_TypeError, "watch: paths must be "
                                "(sub or None, name) pairs");
        }
        st[2 * i] = PyLong_AsLongLong(PyTuple_GET_ITEM(ptrs, i));
        st[2 * i + 1] = PyLong_AsLongLong(PyTuple_GET_ITEM(vers, i));
    }
    PyObject *ref = PyErr_Occurred() ? NULL : PyWeakref_NewRef(owner, NULL);
    if (!ref) {
        PyMem_Free(st);
        return NULL;
    }
    Py_INCREF(paths);
    self->w_owner = ref;
    self->w_paths = paths;
    self->w_state = st;
    Py_RETURN_NONE;
}

/*
 * forward_fast(query, key, value, out, causal, num_threads): the forward
 * of q, k, v alone (no masks, weights, dropout, head mask, cache or
 * positions), positional (METH_FASTCALL), the shapes read from the
 * buffers: the common inference call of mha.Module and the drop-in
 * nn.MultiheadAttention with nothing checked twice.  query (B, Lq, E),
 * key (B, Lk, kdim) or None (self-attention), value (B, Lk, vdim) or None
 * (the key is also the value), out (B, Lq, E).  Returns True when done;
 * NotImplemented, having computed nothing, when an argument is anything
 * else (another dtype, layout or shape) or a watched parameter moved or
 * changed: the caller then takes the full path, which converts, checks
 * and raises as always.
 */
static PyObject *module_forward_fast(ModuleObject *self,
                                     PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6)
        return PyErr_Format(PyExc_TypeError, "forward_fast takes 6 "
                            "arguments, got %zd", nargs);
    long causal = -1, threads = -1;
    if (PyLong_CheckExact(args[4]) && PyLong_CheckExact(args[5])) {
        causal = PyLong_AsLong(args[4]);
        threads = PyLong_AsLong(args[5]);
        if (PyErr_Occurred()) {             /* too large: the full path */
            PyErr_Clear();
            causal = -1;
        }
    }
    if (causal < MHA_CAUSAL_NONE || causal > MHA_CAUSAL_TOP_LEFT ||
        threads < 0 || threads > INT_MAX)
        Py_RETURN_NOTIMPLEMENTED;
    const int ok = watch_ok(self);
    if (ok < 0)
        return NULL;
    if (!ok)
        Py_RETURN_NOTIMPLEMENTED;
    const mha_config *c = &self->cfg;
    bufset b;
    b.n = 0;
    void *pq, *pk, *pv, *pout;
    const Py_ssize_t *sq = NULL, *sk = NULL, *sv = NULL, *so = NULL;
    int plain = !fast_buf(&b, args[0], c->embed_dim, 0, &pq, &sq) && pq &&
                !fast_buf(&b, args[1], c->kdim, 0, &pk, &sk) &&
                !fast_buf(&b, args[2], pk ? c->vdim : c->kdim, 0, &pv, &sv) &&
                !fast_buf(&b, args[3], c->embed_dim, 1, &pout, &so) && pout &&
                !(pv && !pk) && so[0] == sq[0] && so[1] == sq[1] &&
                (!pk || sk[0] == sq[0]) &&
                (!pv || (sv[0] == sk[0] && sv[1] == sk[1]));
    if (!plain) {
        bufs_release(&b);
        Py_RETURN_NOTIMPLEMENTED;
    }
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = sq[0];
    a.q_len = sq[1];
    a.kv_len = pk ? sk[1] : 0;
    a.query = pq;
    a.key = pk;
    a.value = pv;
    a.causal = (mha_causal)causal;
    a.num_threads = (int)threads;
    a.out = pout;
    const mha_status st = forward_kept(self, &a, NULL);
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_TRUE;
}

/*
 * attention_half(q, k, v, out, dtype, causal, scale, threads): mha_attention
 * on 16-bit elements (dtype 2: f16, 3: bf16, mha_dtype's values), q (B,
 * H, Lq, d_h), k (B, H_kv, Lk, d_h), v (B, H_kv, Lk, d_v), out (B, H,
 * Lq, d_v), all C-contiguous arrays of 2-byte items (the bits), read and
 * written in place: the drop-in's short inference call (a call to be
 * differentiated goes through attention() on a 16-bit plan).
 */
static PyObject *attention_half(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8)
        return PyErr_Format(PyExc_TypeError, "attention_half takes 8 "
                            "arguments, got %zd", nargs);
    const long dtype = PyLong_AsLong(args[4]);
    const long causal = PyLong_AsLong(args[5]);
    const long threads = PyLong_AsLong(args[7]);
    double scale = 0.0;
    if (args[6] != Py_None)
        scale = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred())
        return NULL;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    bufset b = {.n = 0};
    void *pq, *pk, *pv, *pout;
    Py_buffer *vq = NULL, *vk = NULL;
    if (get_buf(&b, args[0], "q", T_U16, 0, -1, 1, &pq, &vq) ||
        get_buf(&b, args[1], "k", T_U16, 0, -1, 1, &pk, &vk) ||
        get_buf(&b, args[2], "v", T_U16, 0, -1, 1, &pv, NULL))
        goto fail;
    const Py_buffer *vv = &b.v[2];
    if (vq->ndim != 4 || vk->ndim != 4 || vv->ndim != 4 ||
        vk->shape[0] != vq->shape[0] || vk->shape[3] != vq->shape[3] ||
        memcmp(vk->shape, vv->shape, 3 * sizeof *vk->shape) ||
        vv->shape[3] < 1) {
        PyErr_Format(PyExc_ValueError, "q must be (B, H, Lq, d_h), k (B, "
                     "H_kv, Lk, d_h) and v (B, H_kv, Lk, d_v)");
        goto fail;
    }
    a.batch = vq->shape[0];
    a.num_heads = vq->shape[1];
    a.q_len = vq->shape[2];
    a.head_dim = vq->shape[3];
    a.num_kv_heads = vk->shape[1];
    a.kv_len = vk->shape[2];
    /* values of another head width: out (B, H, Lq, d_v) */
    const int64_t dv = vv->shape[3];
    a.v_head_dim = dv == a.head_dim ? 0 : dv;
    const int64_t n_o = (int64_t)(vq->len / 2) / a.head_dim * dv;
    if (get_buf(&b, args[3], "out", T_U16, 1, n_o, 1, &pout, NULL))
        goto fail;
    a.dtype = (mha_dtype)dtype;
    a.q16 = pq;
    a.k16 = pk;
    a.v16 = pv;
    a.out16 = pout;
    a.layout = MHA_LAYOUT_HEADS_FIRST;
    a.causal = (mha_causal)causal;
    a.num_threads = (int)threads;
    if (args[6] != Py_None) {
        a.scale = (float)scale;
        a.given |= MHA_GIVEN_SCALE;
    }
    mha_status st;
    Py_BEGIN_ALLOW_THREADS
    st = mha_attention(&a);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
fail:
    bufs_release(&b);
    return NULL;
}

static PyObject *bf16_kernel(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    const char *k = mha_bf16_kernel();
    if (!k)
        return raise_status(MHA_ERR_UNSUPPORTED);
    return PyUnicode_FromString(k);
}

static PyMethodDef module_methods[] = {
    {"save", (PyCFunction)module_save, METH_VARARGS, "save(path)"},
    {"forward_fast", (PyCFunction)(void (*)(void))module_forward_fast,
     METH_FASTCALL, "the forward of q, k, v alone, positional; True, or "
     "NotImplemented for anything else"},
    {"watch", (PyCFunction)module_watch, METH_VARARGS,
     "watch(owner, paths, data_ptrs, versions) or watch(None)"},
    {"config", (PyCFunction)module_config, METH_NOARGS,
     "the resolved configuration as a dict"},
    {"params", (PyCFunction)module_params, METH_NOARGS,
     "[(name, shape, numel, offset)] in state_dict order"},
    {"param_numel", (PyCFunction)module_param_numel, METH_NOARGS, NULL},
    {"param_get", (PyCFunction)module_param_get, METH_VARARGS,
     "param_get(name, out)"},
    {"param_set", (PyCFunction)module_param_set, METH_VARARGS,
     "param_set(name, src)"},
    {"reset_parameters", (PyCFunction)module_reset_parameters, METH_VARARGS,
     NULL},
    {"total_keys", (PyCFunction)module_total_keys, METH_VARARGS, NULL},
    {"check_finite", (PyCFunction)module_check_finite, METH_NOARGS,
     "raises NonFiniteError for a NaN or infinite parameter"},
    {"prune_heads", (PyCFunction)module_prune_heads, METH_O,
     "prune_heads(keep) -> new module (mha_prune_heads)"},
    {"project", (PyCFunction)module_project, METH_VARARGS,
     "project(which, x, rows, y)"},
    {"run", (PyCFunction)(void (*)(void))module_run,
     METH_VARARGS | METH_KEYWORDS, "forward, or backward with grad_out"},
    {NULL, NULL, 0, NULL}};

/* The buffer protocol: the module's parameter memory (mha_param_data),
 * writable bytes, so that np.frombuffer(core, np.float32) views every
 * parameter without a copy; the view holds a reference to the module. */
static int module_getbuffer(ModuleObject *self, Py_buffer *view, int flags)
{
    float *data = mha_param_data(self->m);
    int64_t n = mha_param_numel(self->m);
    if (!data || n < 0) {
        PyErr_SetString(PyExc_BufferError, "module has no parameters");
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, data,
                             (Py_ssize_t)n * (Py_ssize_t)sizeof(float), 0,
                             flags);
}

static PyBufferProcs module_as_buffer = {
    .bf_getbuffer = (getbufferproc)module_getbuffer,
};

static PyTypeObject ModuleType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mha._core.Module",
    .tp_basicsize = sizeof(ModuleObject),
    .tp_dealloc = (destructor)module_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a libmha module (mha_module *); made by module_create/load",
    .tp_methods = module_methods,
    .tp_as_buffer = &module_as_buffer,
};

/* ---- the KV cache ------------------------------------------------------ */

static void cache_dealloc(CacheObject *self)
{
    mha_kv_cache_free(self->c);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *cache_create(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kws[] = {"batch", "num_kv_heads", "head_dim", "capacity",
                          "dtype", "window", "page_size", "num_pages",
                          "rotate", "v_head_dim", "latent", NULL};
    mha_kv_cache_config cc;
    memset(&cc, 0, sizeof cc);
    int dtype = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLL|iLLLpLp", kws, &cc.batch,
                                     &cc.num_kv_heads, &cc.head_dim,
                                     &cc.capacity, &dtype, &cc.window,
                                     &cc.page_size, &cc.num_pages,
                                     &cc.rotate, &cc.v_head_dim,
                                     &cc.latent))
        return NULL;
    cc.dtype = (mha_kv_dtype)dtype;
    mha_kv_cache *c = NULL;
    mha_status st = mha_kv_cache_create(&cc, &c);
    if (st != MHA_OK)
        return raise_status(st);
    CacheObject *o = PyObject_New(CacheObject, &CacheType);
    if (!o) {
        mha_kv_cache_free(c);
        return NULL;
    }
    o->c = c;
    o->cfg = cc;
    o->busy = 0;
    return (PyObject *)o;
}

static int cache_check(CacheObject *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the KV cache is in use by another thread");
        return -1;
    }
    return 0;
}

static PyObject *cache_length(CacheObject *self, PyObject *args)
{
    long long seq;
    if (!PyArg_ParseTuple(args, "L", &seq))
        return NULL;
    if (seq < 0 || seq >= self->cfg.batch)
        return PyErr_Format(PyExc_IndexError,
                            "sequence %lld out of range [0, %lld)", seq,
                            (long long)self->cfg.batch);
    return PyLong_FromLongLong(mha_kv_cache_length(self->c, seq));
}

static PyObject *cache_append(CacheObject *self, PyObject *args)
{
    long long seq, n;
    PyObject *k, *v;
    if (!PyArg_ParseTuple(args, "LOOL", &seq, &k, &v, &n))
        return NULL;
    if (cache_check(self))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "n must be >= 0");
    int64_t row = self->cfg.num_kv_heads * self->cfg.head_dim;
    int64_t vrow = self->cfg.num_kv_heads * (self->cfg.v_head_dim
                                                 ? self->cfg.v_head_dim
                                                 : self->cfg.head_dim);
    bufset b = {.n = 0};
    void *pk, *pv;
    if (get_buf(&b, k, "k", T_F32, 0, mul3(n, row, 1), 1, &pk, NULL) ||
        get_buf(&b, v, "v", T_F32, 0, mul3(n, vrow, 1), !self->cfg.latent,
                &pv, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = mha_kv_cache_append(self->c, seq, pk, pv, n);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

/* A cache call of two integers: (seq, length) or (src, dst). */
static PyObject *cache_call2(CacheObject *self, PyObject *args,
                             mha_status (*f)(mha_kv_cache *, int64_t,
                                             int64_t))
{
    long long x, y;
    if (!PyArg_ParseTuple(args, "LL", &x, &y))
        return NULL;
    if (cache_check(self))
        return NULL;
    mha_status st = f(self->c, x, y);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *cache_truncate(CacheObject *self, PyObject *args)
{
    return cache_call2(self, args, mha_kv_cache_truncate);
}

static PyObject *cache_reset(CacheObject *self, PyObject *args)
{
    long long seq = -1;
    if (!PyArg_ParseTuple(args, "|L", &seq))
        return NULL;
    if (cache_check(self))
        return NULL;
    mha_status st = mha_kv_cache_reset(self->c, seq);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *cache_fork(CacheObject *self, PyObject *args)
{
    return cache_call2(self, args, mha_kv_cache_fork);
}

static PyObject *cache_usage(CacheObject *self, PyObject *unused)
{
    (void)unused;
    mha_kv_cache_usage u;
    mha_status st = mha_kv_cache_get_usage(self->c, &u);
    if (st != MHA_OK)
        return raise_status(st);
    return Py_BuildValue("{sLsLsLsLsLsLsL}", "tokens", (long long)u.tokens,
                         "token_bytes", (long long)u.token_bytes, "bytes",
                         (long long)u.bytes, "bytes_total",
                         (long long)u.bytes_total, "page_size",
                         (long long)u.page_size, "pages_used",
                         (long long)u.pages_used, "pages_free",
                         (long long)u.pages_free);
}

/* A ragged decoding step (mha_attention_decode with q_start): q and out
 * (T, H*d_h) float32, q_start (B + 1) int64, lse (T*H) or None. */
static PyObject *cache_decode_ragged(CacheObject *self, PyObject *args,
                                     PyObject *kw)
{
    static char *kws[] = {"q", "out", "q_start", "num_heads", "head_dim",
                          "scale", "given", "num_threads", "lse",
                          "share_prefix", "attention_chunk", NULL};
    PyObject *q, *out, *qs, *lse = Py_None;
    long long H, dh, chunk = 0;
    float scale = 0.0f;
    unsigned int given = 0;
    int threads = 0, share = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOLL|fIiOpL", kws, &q, &out,
                                     &qs, &H, &dh, &scale, &given, &threads,
                                     &lse, &share, &chunk))
        return NULL;
    if (cache_check(self))
        return NULL;
    const int64_t B = self->cfg.batch;
    bufset b = {.n = 0};
    void *pqs, *pq, *pout, *plse;
    if (get_buf(&b, qs, "q_start", T_I64, 0, B + 1, 1, &pqs, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    const int64_t T = ((const int64_t *)pqs)[B];
    const int64_t n = T < 0 ? -1 : mul3(T, H, dh);
    /* out's rows are the cache's values' width */
    const int64_t dv = self->cfg.v_head_dim ? self->cfg.v_head_dim
                                            : self->cfg.head_dim;
    const int64_t n_o = T < 0 ? -1 : mul3(T, H, dv);
    if (get_buf(&b, q, "q", T_F32, 0, n, 1, &pq, NULL) ||
        get_buf(&b, out, "out", T_F32, 1, n_o, 1, &pout, NULL) ||
        get_buf(&b, lse, "lse", T_F32, 1, T < 0 ? -1 : mul3(T, H, 1), 0,
                &plse, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_attention_decode_args d;
    memset(&d, 0, sizeof d);
    d.batch = B;
    d.num_heads = H;
    d.head_dim = dh;
    d.q = pq;
    d.out = pout;
    d.cache = self->c;
    d.scale = scale;
    d.given = given;
    d.lse = plse;
    d.num_threads = threads;
    d.q_start = pqs;
    d.share_prefix = share;
    d.attention_chunk = chunk;
    mha_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = mha_attention_decode(&d);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *cache_read(CacheObject *self, PyObject *args)
{
    long long seq, start, n;
    PyObject *k, *v;
    if (!PyArg_ParseTuple(args, "LLLOO", &seq, &start, &n, &k, &v))
        return NULL;
    if (cache_check(self))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "n must be >= 0");
    int64_t row = self->cfg.num_kv_heads * self->cfg.head_dim;
    int64_t vrow = self->cfg.num_kv_heads * (self->cfg.v_head_dim
                                                 ? self->cfg.v_head_dim
                                                 : self->cfg.head_dim);
    bufset b = {.n = 0};
    void *pk, *pv;
    if (get_buf(&b, k, "k", T_F32, 1, mul3(n, row, 1), 0, &pk, NULL) ||
        get_buf(&b, v, "v", T_F32, 1, mul3(n, vrow, 1), 0, &pv, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st = mha_kv_cache_read(self->c, seq, start, n, pk, pv);
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *cache_config(CacheObject *self, PyObject *unused)
{
    (void)unused;
    const mha_kv_cache_config *c = &self->cfg;
    return Py_BuildValue("{sLsLsLsLsisLsLsLsisLsi}", "batch", (long long)c->batch,
                         "num_kv_heads", (long long)c->num_kv_heads,
                         "head_dim", (long long)c->head_dim, "capacity",
                         (long long)c->capacity, "dtype", (int)c->dtype,
                         "window", (long long)c->window, "page_size",
                         (long long)c->page_size, "num_pages",
                         (long long)c->num_pages, "rotate", c->rotate,
                         "v_head_dim", (long long)(c->v_head_dim
                                                       ? c->v_head_dim
                                                       : c->head_dim),
                         "latent", c->latent);
}

static PyMethodDef cache_methods[] = {
    {"length", (PyCFunction)cache_length, METH_VARARGS, "length(seq)"},
    {"append", (PyCFunction)cache_append, METH_VARARGS,
     "append(seq, k, v, n)"},
    {"truncate", (PyCFunction)cache_truncate, METH_VARARGS,
     "truncate(seq, length)"},
    {"reset", (PyCFunction)cache_reset, METH_VARARGS, "reset(seq=-1)"},
    {"read", (PyCFunction)cache_read, METH_VARARGS,
     "read(seq, start, n, k, v)"},
    {"fork", (PyCFunction)cache_fork, METH_VARARGS, "fork(src, dst)"},
    {"decode_ragged", (PyCFunction)(void (*)(void))cache_decode_ragged,
     METH_VARARGS | METH_KEYWORDS,
     "decode_ragged(q, out, q_start, num_heads, head_dim, scale=0, "
     "given=0, num_threads=0, lse=None, share_prefix=False)"},
    {"usage", (PyCFunction)cache_usage, METH_NOARGS, "usage()"},
    {"config", (PyCFunction)cache_config, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mha._core.KVCache",
    .tp_basicsize = sizeof(CacheObject),
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a libmha KV cache (mha_kv_cache *); made by kv_cache_create",
    .tp_methods = cache_methods,
};

/* ---- attention on heads ------------------------------------------------ */

/*
 * heads_first: torch's SDPA layout.  q, k, v and grad_out are 4-D arrays
 * (B, H, L, d_h) (k, v: H_kv heads) of any strides -- NumPy views of
 * torch tensors as they come, contiguous or transposed views of (B, L, H,
 * d_h) tensors (how models make them), even expanded -- and the outputs
 * (out, grad_q, grad_k, grad_v) C-contiguous (B, L, H, d_h), libmha's own
 * layout, which the caller views as (B, H, L, d_h) by a transpose.  An
 * input already in libmha's layout is read in place; any other is
 * gathered into it once, with the GIL released.  heads_first = 2: every
 * one of them C-contiguous (B, H, L, d_h), read and written in place
 * (MHA_LAYOUT_HEADS_FIRST), backward and plans included.
 */
typedef struct strided4 {
    const char *base;
    int64_t n[4];        /* B, H, L, d */
    Py_ssize_t st[4];    /* strides in bytes */
} strided4;

/* A 4-D float32 input of shape (B, H, L, d), any strides (see above). */
static int get_buf4(bufset *b, PyObject *o, const char *name, int64_t B,
                    int64_t H, int64_t L, int64_t d, strided4 *x)
{
    if (o == NULL || o == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s is required, got None", name);
        return -1;
    }
    if (b->n >= MAX_BUFS) {
        PyErr_SetString(PyExc_RuntimeError, "too many buffers in one call");
        return -1;
    }
    if (!PyObject_CheckBuffer(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a float32 array (a "
                     "buffer), not %s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    Py_buffer *v = &b->v[b->n];
    if (PyObject_GetBuffer(o, v, PyBUF_RECORDS_RO) != 0)
        return -1;
    b->n++;
    if (!format_ok(v, T_F32)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype float32, got "
                     "format '%s'", name, v->format ? v->format : "B");
        return -1;
    }
    const int64_t want[4] = {B, H, L, d};
    int ok = v->ndim == 4;
    for (int i = 0; ok && i < 4; i++)
        ok = v->shape[i] == want[i] && v->strides[i] % 4 == 0;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be a (%lld, %lld, %lld, "
                     "%lld) float32 array with strides of whole elements",
                     name, (long long)B, (long long)H, (long long)L,
                     (long long)d);
        return -1;
    }
    x->base = v->buf;
    for (int i = 0; i < 4; i++) {
        x->n[i] = want[i];
        x->st[i] = v->strides[i];
    }
    return 0;
}

/* Is x libmha's (B, L, H, d) layout, C-contiguous?  (A dimension of size
 * 1 may have any stride.) */
static int in_place(const strided4 *x)
{
    const int64_t B = x->n[0], H = x->n[1], L = x->n[2], d = x->n[3];
    return (d == 1 || x->st[3] == 4) && (H == 1 || x->st[1] == 4 * d) &&
           (L == 1 || x->st[2] == 4 * H * d) &&
           (B == 1 || x->st[0] == 4 * L * H * d);
}

/* x into libmha's layout at dst (B, L, H, d), C-contiguous. */
static void gather(float *dst, const strided4 *x)
{
    const int64_t B = x->n[0], H = x->n[1], L = x->n[2], d = x->n[3];
    /* heads outside, rows inside: a contiguous (B, H, L, d) source is
     * read in order, and each destination row of a head is H*d apart */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < L; i++) {
                const char *src = x->base + b * x->st[0] + h * x->st[1] +
                                  i * x->st[2];
                float *y = dst + ((b * L + i) * H + h) * d;
                if (x->st[3] == 4)
                    memcpy(y, src, (size_t)d * sizeof *y);
                else
                    for (int64_t c = 0; c < d; c++)
                        memcpy(y + c, src + c * x->st[3], sizeof *y);
            }
}

/* The inputs q, k, v (and grad_out, NULL in the forward) in libmha's
 * layout: each read in place when it is, else gathered into a buffer of
 * its own (scratch[i], freed by the caller; one allocation per tensor, of
 * the size NumPy's and torch's own copies make, which glibc serves from
 * its heap after the first call instead of a fresh mmap, page faults and
 * all, each time).  Sets a->q, k, v and *grad_out.  Returns MHA_OK or
 * MHA_ERR_OUT_OF_MEMORY (with a message). */
/* The decode step that attention arguments with a cache stand for. */
static mha_status attention_decode(const mha_attention_args *a)
{
    mha_attention_decode_args d;
    memset(&d, 0, sizeof d);
    d.batch = a->batch;
    d.num_heads = a->num_heads;
    d.head_dim = a->head_dim;
    d.q_len = a->q_len;
    d.q = a->q;
    d.out = a->out;
    d.cache = a->cache;
    d.scale = a->scale;
    d.given = a->given;
    d.attn_mask = a->attn_mask;
    d.key_padding_mask = a->key_padding_mask;
    d.key_lengths = a->key_lengths;
    d.need_weights = a->need_weights;
    d.attn_weights = a->attn_weights;
    d.lse = a->lse;
    d.mods = a->mods;
    d.sinks = a->sinks;
    d.q_positions = a->q_positions;
    d.num_threads = a->num_threads;
    d.dtype = a->dtype;
    d.q16 = a->q16;
    d.out16 = a->out16;
    return mha_attention_decode(&d);
}

static mha_status heads_first_inputs(mha_attention_args *a,
                                     const strided4 *x, int nx,
                                     const float **grad_out,
                                     float **scratch)
{
    const float *p[4];
    for (int i = 0; i < nx; i++) {
        if (in_place(&x[i])) {
            p[i] = (const float *)x[i].base;
            continue;
        }
        const int64_t n = x[i].n[0] * x[i].n[1] * x[i].n[2] * x[i].n[3];
        if (!(scratch[i] = malloc((size_t)(n + 1) * sizeof(float))))
            return mha_error_set(MHA_ERR_OUT_OF_MEMORY,
                                 "heads_first: out of memory for the inputs "
                                 "in libmha's layout");
        gather(scratch[i], &x[i]);
        p[i] = scratch[i];
    }
    a->q = p[0];
    a->k = p[1];
    a->v = p[2];
    if (nx == 4)
        *grad_out = p[3];
    return MHA_OK;
}

/* An attention plan kept by Python between a forward and its backward
 * (the drop-in's autograd): the capsule's pointer, and whether a call is
 * using it now. */
typedef struct {
    mha_attention_plan *plan;
    int busy;
} kept_plan;

static void kept_plan_free(PyObject *capsule)
{
    kept_plan *k = PyCapsule_GetPointer(capsule, "mha.attention_plan");
    if (k) {
        mha_attention_plan_free(k->plan);
        free(k);
    }
}

static PyObject *attention(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kws[] = {
        "q", "k", "v", "out", "batch", "num_heads", "head_dim", "q_len",
        "kv_len", "num_kv_heads", "scale", "attn_mask", "attn_mask_kind",
        "key_padding_mask", "key_padding_mask_kind", "key_lengths", "causal",
        "need_weights", "attn_weights", "dropout", "training",
        "dropout_seed", "num_threads", "lse", "cache", "modifiers", "sinks",
        "q_positions", "k_positions", "grad_out", "grad_q", "grad_k",
        "grad_v", "grad_sinks", "heads_first", "plan", "dtype",
        "v_head_dim", NULL};
    PyObject *q, *k = Py_None, *v = Py_None, *out = Py_None;
    PyObject *scale = Py_None, *am = Py_None, *kpm = Py_None, *kl = Py_None;
    PyObject *w = Py_None, *lse = Py_None, *cache = Py_None, *mods = Py_None;
    PyObject *sinks = Py_None, *qp = Py_None, *kp = Py_None;
    PyObject *go = Py_None, *gq = Py_None, *gk = Py_None, *gv = Py_None;
    PyObject *gs = Py_None, *plan = Py_None;
    long long B, H, dh, Lq, Lk = 0, Hkv = 0, dvh = 0;
    int amk = 0, kpmk = 0, causal = 0, nw = 0, training = 0, threads = 0;
    int heads_first = 0, dtype = MHA_DTYPE_F32;
    float dropout = 0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "OOOOLLLL|LLOOiOiOiiOfpKiOOOOOOOOOOOiOiL", kws, &q, &k,
            &v, &out, &B, &H, &dh, &Lq, &Lk, &Hkv, &scale, &am, &amk, &kpm,
            &kpmk, &kl, &causal, &nw, &w, &dropout, &training, &seed,
            &threads, &lse, &cache, &mods, &sinks, &qp, &kp, &go, &gq, &gk,
            &gv, &gs, &heads_first, &plan, &dtype, &dvh))
        return NULL;
    /* dtype BF16 / F16: q, k, v, out (and grad_out, grad_q, grad_k,
     * grad_v) hold 16-bit elements, in the rows layout or contiguous
     * heads first (the library refuses what else a 16-bit call does not
     * take); a plan is then a 16-bit plan */
    const int td = dtype == MHA_DTYPE_F32 ? T_F32 : T_U16;
    if (dtype != MHA_DTYPE_F32 && heads_first == 1)
        return PyErr_Format(PyExc_ValueError,
                            "16-bit data: no strided heads-first views "
                            "(give contiguous arrays)");
    if (heads_first && cache != Py_None)
        return PyErr_Format(PyExc_ValueError,
                            "heads_first: not with a KV cache");
    if (heads_first < 0 || heads_first > 2)
        return PyErr_Format(PyExc_ValueError, "heads_first must be 0, 1 or "
                            "2, got %d", heads_first);
    const int gather = heads_first == 1;   /* strided4 inputs */
    /* plan: None (unplanned), True (a forward makes one and returns it) or
     * such a capsule (a forward runs on it, a backward differentiates its
     * last run): rows layout, no cache */
    kept_plan *kp_ = NULL;
    if (plan != Py_None) {
        if (gather || cache != Py_None)
            return PyErr_Format(PyExc_ValueError, "plan: C-contiguous "
                                "buffers and no KV cache only");
        if (plan != Py_True) {
            kp_ = PyCapsule_GetPointer(plan, "mha.attention_plan");
            if (!kp_)
                return NULL;
            if (kp_->busy)
                return PyErr_Format(PyExc_RuntimeError, "the attention plan "
                                    "is in use by another thread");
        }
    }
    if (B < 1 || H < 1 || dh < 1 || Lq < 1 || Lk < 0 || Hkv < 0)
        return PyErr_Format(PyExc_ValueError,
                            "batch, num_heads, head_dim and q_len must be "
                            ">= 1, kv_len and num_kv_heads >= 0");
    if (Hkv == 0)
        Hkv = H;
    CacheObject *co = NULL;
    if (cache != Py_None) {
        if (!PyObject_TypeCheck(cache, &CacheType))
            return PyErr_Format(PyExc_TypeError, "cache must be a KVCache");
        co = (CacheObject *)cache;
        if (co->busy)
            return PyErr_Format(PyExc_RuntimeError,
                                "the KV cache is in use by another thread");
    }
    int backward = go != Py_None;
    int64_t lk = Lk ? Lk : Lq;
    if (co && !Lk)
        lk = cache_max_len(&co->cfg, co->c);
    /* values and outputs: heads of dv (v_head_dim, 0: the cache's, else
     * head_dim) */
    const int64_t dv = dvh > 0                      ? dvh
                     : co && co->cfg.v_head_dim > 0 ? co->cfg.v_head_dim
                                                    : dh;
    int64_t qn = mul3(B, Lq, mul3(H, dh, 1)),
            kn = mul3(B, lk, mul3(Hkv, dh, 1)),
            vn = mul3(B, lk, mul3(Hkv, dv, 1)),
            on = mul3(B, Lq, mul3(H, dv, 1));
    int64_t wn = nw == MHA_WEIGHTS_AVERAGE ? mul3(B, Lq, lk)
               : nw == MHA_WEIGHTS_PER_HEAD ? mul3(mul3(B, H, Lq), lk, 1) : 0;

    mha_attention_args a;
    memset(&a, 0, sizeof a);
    bufset b = {.n = 0};
    void *pq = NULL, *pk = NULL, *pv = NULL;
    void *pout, *pw, *pkl, *plse, *psinks, *pqp, *pkp;
    strided4 x4[4];   /* heads_first: q, k, v, grad_out */
    if ((gather
             ? get_buf4(&b, q, "q", B, H, Lq, dh, &x4[0]) ||
                   get_buf4(&b, k, "k", B, Hkv, lk, dh, &x4[1]) ||
                   get_buf4(&b, v, "v", B, Hkv, lk, dv, &x4[2])
             : get_buf(&b, q, "q", td, 0, qn, 1, &pq, NULL) ||
                   get_buf(&b, k, "k", td, 0, kn, !co, &pk, NULL) ||
                   get_buf(&b, v, "v", td, 0, vn, !co, &pv, NULL)) ||
        get_buf(&b, out, "out", td, 1, on, !backward, &pout, NULL) ||
        get_buf(&b, w, "attn_weights", T_F32, 1, wn, nw != 0 && !backward,
                &pw, NULL) ||
        get_buf(&b, kl, "key_lengths", T_I64, 0, B, 0, &pkl, NULL) ||
        get_buf(&b, lse, "lse", T_F32, 1, mul3(B, H, Lq), 0, &plse, NULL) ||
        get_buf(&b, sinks, "sinks", T_F32, 0, H, 0, &psinks, NULL) ||
        get_buf(&b, qp, "q_positions", T_I64, 0, mul3(B, Lq, 1), 0, &pqp, NULL) ||
        get_buf(&b, kp, "k_positions", T_I64, 0, mul3(B, lk, 1), 0, &pkp, NULL) ||
        get_mask(&b, am, amk, "attn_mask", &a.attn_mask) ||
        get_mask(&b, kpm, kpmk, "key_padding_mask", &a.key_padding_mask) ||
        get_mods(&b, mods, H, &a.mods, &a.attention_chunk))
        goto fail;
    a.batch = B;
    a.num_heads = H;
    a.head_dim = dh;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.num_kv_heads = Hkv;
    a.v_head_dim = dvh;
    a.q = pq;
    a.k = pk;
    a.v = pv;
    if (scale != Py_None) {
        a.scale = (float)PyFloat_AsDouble(scale);
        if (PyErr_Occurred())
            goto fail;
        a.given |= MHA_GIVEN_SCALE;
    }
    a.key_lengths = pkl;
    a.causal = (mha_causal)causal;
    a.need_weights = (mha_weights_mode)nw;
    a.attn_weights = pw;
    a.dropout = dropout;
    a.training = training;
    a.dropout_seed = seed;
    a.num_threads = threads;
    a.out = pout;
    a.lse = plse;
    a.cache = co ? co->c : NULL;
    a.sinks = psinks;
    a.q_positions = pqp;
    a.k_positions = pkp;
    if (heads_first == 2)
        a.layout = MHA_LAYOUT_HEADS_FIRST;
    if (dtype != MHA_DTYPE_F32) {
        a.dtype = (mha_dtype)dtype;
        a.q16 = pq;
        a.k16 = pk;
        a.v16 = pv;
        a.out16 = pout;
        a.q = a.k = a.v = a.out = NULL;
    }

    mha_attention_grads g;
    memset(&g, 0, sizeof g);
    mha_attention_grads16 g16;
    memset(&g16, 0, sizeof g16);
    if (backward) {
        void *pgo = NULL, *pgq, *pgk, *pgv, *pgs;
        if ((gather
                 ? get_buf4(&b, go, "grad_out", B, H, Lq, dv, &x4[3])
                 : get_buf(&b, go, "grad_out", td, 0, on, 1, &pgo,
                           NULL)) ||
            get_buf(&b, gq, "grad_q", td, 1, qn, 1, &pgq, NULL) ||
            get_buf(&b, gk, "grad_k", td, 1, kn, 1, &pgk, NULL) ||
            get_buf(&b, gv, "grad_v", td, 1, vn, 1, &pgv, NULL) ||
            get_buf(&b, gs, "grad_sinks", T_F32, 1, H, 0, &pgs, NULL))
            goto fail;
        g.grad_out = pgo;
        g.grad_q = pgq;
        g.grad_k = pgk;
        g.grad_v = pgv;
        g.grad_sinks = pgs;
        g16 = (mha_attention_grads16){.grad_out = pgo, .grad_q = pgq,
                                      .grad_k = pgk, .grad_v = pgv,
                                      .grad_sinks = pgs};
        a.need_weights = MHA_WEIGHTS_NONE;
        a.attn_weights = NULL;
        a.lse = NULL;
    }
    if (co && !backward && (pk || pv || training || heads_first ||
                            pkp || causal == MHA_CAUSAL_TOP_LEFT)) {
        bufs_release(&b);
        return raise_status(mha_error_set(
            MHA_ERR_INVALID_ARGUMENT,
            pk || pv ? "with a KV cache, k and v must be unset: the keys "
                       "are the cache's"
            : training ? "with a KV cache, training must be unset: a "
                         "decoding step has no backward"
            : heads_first ? "with a KV cache, the layout is rows: a cache "
                            "is not read heads first"
            : pkp ? "with a KV cache, k_positions must be unset: the cache "
                    "holds keys rotated already"
                  : "with a KV cache, causal masking is bottom-right: "
                    "top-left is refused"));
    }
    mha_status st = MHA_OK;
    float *scratch[4] = {NULL, NULL, NULL, NULL};
    mha_attention_plan *made = NULL;
    if (co)
        co->busy = 1;
    if (kp_)
        kp_->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (gather)
        st = heads_first_inputs(&a, x4, backward ? 4 : 3, &g.grad_out,
                                scratch);
    if (st == MHA_OK && co && !backward)
        st = attention_decode(&a);
    else if (st == MHA_OK && plan != Py_None && backward)
        st = !kp_ ? mha_error_set(MHA_ERR_INVALID_ARGUMENT, "a backward "
                                  "takes the plan its forward returned")
           : dtype != MHA_DTYPE_F32
               ? mha_attention_plan_backward16(kp_->plan, &a, &g16)
               : mha_attention_plan_backward(kp_->plan, &a, &g);
    else if (st == MHA_OK && plan != Py_None)
        st = kp_ ? mha_attention_plan_run(kp_->plan, &a)
                 : mha_attention_plan_create(&a, &made);
    else if (st == MHA_OK && dtype != MHA_DTYPE_F32 && backward)
        st = mha_attention_backward16(&a, &g16);
    else if (st == MHA_OK)
        st = backward ? mha_attention_backward(&a, &g) : mha_attention(&a);
    if (st == MHA_OK && made) {
        st = mha_attention_plan_run(made, &a);
        if (st != MHA_OK) {
            mha_attention_plan_free(made);
            made = NULL;
        }
    }
    for (int i = 0; i < 4; i++)
        free(scratch[i]);
    Py_END_ALLOW_THREADS
    if (co)
        co->busy = 0;
    if (kp_)
        kp_->busy = 0;
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    if (made) {
        kept_plan *kept = malloc(sizeof *kept);
        PyObject *cap = kept ? PyCapsule_New(kept, "mha.attention_plan",
                                             kept_plan_free) : NULL;
        if (!cap) {
            free(kept);
            mha_attention_plan_free(made);
            return kept ? NULL : PyErr_NoMemory();
        }
        *kept = (kept_plan){made, 0};
        return cap;
    }
    if (kp_ && !backward) {
        Py_INCREF(plan);
        return plan;
    }
    Py_RETURN_NONE;
fail:
    bufs_release(&b);
    return NULL;
}

/*
 * attention_plain(q, k, v, out, heads_first, num_heads, num_kv_heads,
 *                 causal, scale, num_threads[, key_mask]): the drop-ins'
 * common call,
 * nothing but q, k, v (no masks, modifiers, sinks, dropout, weights or
 * cache), positional (METH_FASTCALL) and with the shapes read from the
 * buffers, so that a call costs what it must and no keyword parsing:
 *   heads_first 0: q (B, Lq, H*d_h), k and v (B, Lk, H_kv*d_h),
 *                  C-contiguous (mha.attention's layout; num_heads says
 *                  H, num_kv_heads H_kv or 0 for H);
 *   heads_first 1: q (B, H, Lq, d_h), k and v (B, H_kv, Lk, d_h), any
 *                  strides (SDPA's; see heads_first above; the head
 *                  counts come from the shapes); out (B, Lq, H*d_h);
 *   heads_first 2: q, k and v as for 1 but C-contiguous, read in place
 *                  (MHA_LAYOUT_HEADS_FIRST), and out (B, H, Lq, d_h).
 *   out C-contiguous, written.  causal: mha_causal.  scale: None
 *   (1/sqrt(d_h)) or a float.  key_mask: None or a (B, Lk) bool array,
 *   True = the key takes part (a padded batch's decoding step).
 */
static PyObject *attention_plain(PyObject *self, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 10 && nargs != 11)
        return PyErr_Format(PyExc_TypeError, "attention_plain takes 10 or "
                            "11 arguments, got %zd", nargs);
    const long heads_first = PyLong_AsLong(args[4]);
    const long long H0 = PyLong_AsLongLong(args[5]);
    const long long Hkv0 = PyLong_AsLongLong(args[6]);
    const long causal = PyLong_AsLong(args[7]);
    const long threads = PyLong_AsLong(args[9]);
    double scale = 0.0;
    if (args[8] != Py_None)
        scale = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (heads_first < 0 || heads_first > 2)
        return PyErr_Format(PyExc_ValueError, "heads_first must be 0, 1 or "
                            "2, got %ld", heads_first);
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    bufset b = {.n = 0};
    strided4 x4[3];
    float *scratch[4] = {NULL, NULL, NULL, NULL};
    void *pq, *pk, *pv, *pout;
    Py_buffer *vq = NULL, *vk = NULL;
    int64_t B, H, Hkv, dh, Lq, Lk;
    if (heads_first == 2) {
        /* (B, H, L, d_h), C-contiguous: the shapes from the buffers */
        if (get_buf(&b, args[0], "q", T_F32, 0, -1, 1, &pq, &vq) ||
            get_buf(&b, args[1], "k", T_F32, 0, -1, 1, &pk, &vk) ||
            get_buf(&b, args[2], "v", T_F32, 0, -1, 1, &pv, NULL))
            goto fail;
        const Py_buffer *vv = &b.v[2];
        if (vq->ndim != 4 || vk->ndim != 4 || vv->ndim != 4 ||
            vk->shape[0] != vq->shape[0] || vk->shape[3] != vq->shape[3] ||
            memcmp(vk->shape, vv->shape, 4 * sizeof *vk->shape)) {
            PyErr_Format(PyExc_ValueError, "q must be (B, H, Lq, d_h), k "
                         "and v (B, H_kv, Lk, d_h), the same shape");
            goto fail;
        }
        B = vq->shape[0];
        H = vq->shape[1];
        Lq = vq->shape[2];
        dh = vq->shape[3];
        Hkv = vk->shape[1];
        Lk = vk->shape[2];
        a.q = pq;
        a.k = pk;
        a.v = pv;
        a.layout = MHA_LAYOUT_HEADS_FIRST;
    } else if (heads_first) {
        /* the shapes from q's and k's buffers, then all three checked */
        Py_buffer probe;
        if (PyObject_GetBuffer(args[0], &probe, PyBUF_RECORDS_RO) != 0)
            return NULL;
        const int ok = probe.ndim == 4;
        B = ok ? probe.shape[0] : 0;
        H = ok ? probe.shape[1] : 0;
        Lq = ok ? probe.shape[2] : 0;
        dh = ok ? probe.shape[3] : 0;
        PyBuffer_Release(&probe);
        if (PyObject_GetBuffer(args[1], &probe, PyBUF_RECORDS_RO) != 0)
            return NULL;
        const int okk = probe.ndim == 4;
        Hkv = okk ? probe.shape[1] : 0;
        Lk = okk ? probe.shape[2] : 0;
        PyBuffer_Release(&probe);
        if (!ok || !okk)
            return PyErr_Format(PyExc_ValueError, "q and k must be 4-D "
                                "(B, H, L, d_h) arrays");
        if (get_buf4(&b, args[0], "q", B, H, Lq, dh, &x4[0]) ||
            get_buf4(&b, args[1], "k", B, Hkv, Lk, dh, &x4[1]) ||
            get_buf4(&b, args[2], "v", B, Hkv, Lk, dh, &x4[2]))
            goto fail;
    } else {
        if (get_buf(&b, args[0], "q", T_F32, 0, -1, 1, &pq, &vq) ||
            get_buf(&b, args[1], "k", T_F32, 0, -1, 1, &pk, &vk) ||
            get_buf(&b, args[2], "v", T_F32, 0, -1, 1, &pv, NULL))
            goto fail;
        H = H0;
        Hkv = Hkv0 ? Hkv0 : H0;
        if (vq->ndim != 3 || vk->ndim != 3 || H < 1 || Hkv < 1 ||
            vq->shape[2] % H) {
            PyErr_Format(PyExc_ValueError, "q and k must be (B, L, H*d_h) "
                         "arrays with H = %lld dividing q's last dimension",
                         (long long)H);
            goto fail;
        }
        B = vq->shape[0];
        Lq = vq->shape[1];
        dh = vq->shape[2] / H;
        Lk = vk->shape[1];
        if (vk->shape[0] != B || vk->shape[2] != Hkv * dh ||
            b.v[2].len != vk->len) {
            PyErr_Format(PyExc_ValueError, "k and v must be (%lld, Lk, "
                         "%lld) (num_kv_heads x head_dim), the same shape",
                         (long long)B, (long long)(Hkv * dh));
            goto fail;
        }
        a.q = pq;
        a.k = pk;
        a.v = pv;
    }
    if (B < 1 || Lq < 1 || Lk < 1) {
        PyErr_Format(PyExc_ValueError, "batch, q_len and kv_len must be >= "
                     "1");
        goto fail;
    }
    if (get_buf(&b, args[3], "out", T_F32, 1, mul3(B, Lq, mul3(H, dh, 1)), 1,
                &pout, NULL) ||
        (nargs == 11 && get_mask(&b, args[10], MHA_MASK_ALLOW, "key_mask",
                                 &a.key_padding_mask)))
        goto fail;
    a.batch = B;
    a.num_heads = H;
    a.num_kv_heads = Hkv;
    a.head_dim = dh;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.causal = (mha_causal)causal;
    a.num_threads = (int)threads;
    a.out = pout;
    if (args[8] != Py_None) {
        a.scale = (float)scale;
        a.given |= MHA_GIVEN_SCALE;
    }
    mha_status st = MHA_OK;
    Py_BEGIN_ALLOW_THREADS
    if (heads_first == 1)
        st = heads_first_inputs(&a, x4, 3, NULL, scratch);
    if (st == MHA_OK)
        st = mha_attention(&a);
    for (int i = 0; i < 4; i++)
        free(scratch[i]);
    Py_END_ALLOW_THREADS
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
fail:
    bufs_release(&b);
    return NULL;
}

/* ---- small functions --------------------------------------------------- */

static PyObject *alibi_slopes(PyObject *self, PyObject *args)
{
    (void)self;
    long long h;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "LO", &h, &out))
        return NULL;
    if (h < 1)
        return PyErr_Format(PyExc_ValueError, "num_heads must be >= 1");
    bufset b = {.n = 0};
    void *p;
    if (get_buf(&b, out, "out", T_F32, 1, h, 1, &p, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st = mha_alibi_slopes(h, p);
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

/* rope_apply(x, rows, heads, head_dim, style, dims, theta, scale,
 *            positions|None, pos0): rotates x (rows, heads*head_dim) */
static PyObject *rope_apply(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *x, *pos;
    long long rows, heads, dh, pos0;
    mha_rope r;
    int style;
    memset(&r, 0, sizeof r);
    if (!PyArg_ParseTuple(args, "OLLLiLffOL", &x, &rows, &heads, &dh, &style,
                          &r.dims, &r.theta, &r.scale, &pos, &pos0))
        return NULL;
    if (rows < 0 || heads < 1 || dh < 1)
        return PyErr_Format(PyExc_ValueError, "bad rows, heads or head_dim");
    r.style = (mha_rope_style)style;
    bufset b = {.n = 0};
    void *px, *pp;
    if (get_buf(&b, x, "x", T_F32, 1, mul3(rows, heads, dh), 1, &px, NULL) ||
        get_buf(&b, pos, "positions", T_I64, 0, rows, 0, &pp, NULL)) {
        bufs_release(&b);
        return NULL;
    }
    mha_status st = mha_rope_apply(&r, rows, heads, dh, pp, pos0, px,
                                   heads * dh);
    bufs_release(&b);
    if (st != MHA_OK)
        return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *dropout_keep(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long seed;
    float p;
    long long bb, h, i, j;
    if (!PyArg_ParseTuple(args, "KfLLLL", &seed, &p, &bb, &h, &i, &j))
        return NULL;
    return PyBool_FromLong(mha_dropout_keep(seed, p, bb, h, i, j));
}

/* A name the library reports, or None where it has none. */
static PyObject *name_or_none(const char *name)
{
    if (!name)
        Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

static PyObject *kernel_tier(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return name_or_none(mha_kernel_tier());
}

static PyObject *gemm_backend(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return name_or_none(mha_gemm_backend());
}

static PyObject *version(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(mha_version_string());
}

static PyMethodDef core_methods[] = {
    {"_set_errors", set_errors, METH_O, "status -> exception class"},
    {"module_create", (PyCFunction)(void (*)(void))module_create,
     METH_VARARGS | METH_KEYWORDS, "mha_create"},
    {"module_load", (PyCFunction)(void (*)(void))module_load,
     METH_VARARGS | METH_KEYWORDS, "mha_module_from_file"},
    {"kv_cache_create", (PyCFunction)(void (*)(void))cache_create,
     METH_VARARGS | METH_KEYWORDS, "mha_kv_cache_create"},
    {"attention", (PyCFunction)(void (*)(void))attention,
     METH_VARARGS | METH_KEYWORDS,
     "mha_attention, or mha_attention_backward with grad_out"},
    {"attention_plain", (PyCFunction)(void (*)(void))attention_plain,
     METH_FASTCALL, "mha_attention on q, k, v alone, positional"},
    {"attention_half", (PyCFunction)(void (*)(void))attention_half,
     METH_FASTCALL, "mha_attention on bf16 / f16 q, k, v (heads first)"},
    {"bf16_kernel", bf16_kernel, METH_NOARGS,
     "mha_bf16_kernel(): 'amx', 'avx512bf16', 'bfdot' or 'float32'"},
    {"alibi_slopes", alibi_slopes, METH_VARARGS, "alibi_slopes(H, out)"},
    {"rope_apply", rope_apply, METH_VARARGS, "mha_rope_apply"},
    {"dropout_keep", dropout_keep, METH_VARARGS, "mha_dropout_keep"},
    {"kernel_tier", kernel_tier, METH_NOARGS, "mha_kernel_tier"},
    {"gemm_backend", gemm_backend, METH_NOARGS, "mha_gemm_backend"},
    {"version", version, METH_NOARGS, "mha_version_string"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef core_def = {
    PyModuleDef_HEAD_INIT, "mha._core",
    "The C binding of libmha; use the mha package above it.", -1,
    core_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void)
{
    if (!MHA_ABI_OK()) {
        PyErr_Format(PyExc_ImportError,
                     "libmha %s does not match the headers mha._core was "
                     "built with", mha_version_string());
        return NULL;
    }
    if (PyType_Ready(&ModuleType) < 0 || PyType_Ready(&CacheType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&core_def);
    if (!m)
        return NULL;
    Py_INCREF(&ModuleType);
    Py_INCREF(&CacheType);
    if (PyModule_AddObject(m, "Module", (PyObject *)&ModuleType) < 0 ||
        PyModule_AddObject(m, "KVCache", (PyObject *)&CacheType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
