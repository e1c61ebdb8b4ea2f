/*
 * test_abi.c -- the ABI rule of include/mha.h: every struct travels with
 * its size.  A program built against an older mha.h passes a shorter
 * struct (a prefix of today's: structs only grow at their end), and the
 * library must read nothing past it; one built against a newer mha.h
 * passes a longer one, which runs while the unknown tail is zero and is
 * refused, naming the struct, when it is not.  Each older size below
 * stops before fields that were added to the struct after the others
 * (16-bit data, grouped-query attention, query slices, window caches):
 * an earlier header's layout.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "testutil.h"

enum { B = 2, H = 4, DH = 8, L = 6, E = H * DH };

static void fill_attention(mha_attention_args *a, const float *q,
                           const float *k, const float *v, float *out)
{
    memset(a, 0, sizeof *a);
    a->batch = B;
    a->num_heads = H;
    a->head_dim = DH;
    a->q_len = L;
    a->q = q;
    a->k = k;
    a->v = v;
    a->out = out;
    a->causal = MHA_CAUSAL_BOTTOM_RIGHT;
}

/* An older program's mha_attention_args: the bytes past its size hold
 * whatever its stack held there (here: fields that would be refused or
 * would crash if read), and the call must equal today's with them zero. */
static void test_older_attention_args(void **state)
{
    (void)state;
    float q[B * L * E], k[B * L * E], v[B * L * E];
    float want[B * L * E], got[B * L * E];
    tu_fill(q, B * L * E, 1, -1, 1);
    tu_fill(k, B * L * E, 2, -1, 1);
    tu_fill(v, B * L * E, 3, -1, 1);
    mha_attention_args a;
    fill_attention(&a, q, k, v, want);
    assert_int_equal(mha_attention(&a), MHA_OK);

    const size_t older = offsetof(mha_attention_args, dtype);
    mha_attention_args old;
    memset(&old, 0x5A, sizeof old);   /* garbage past the older size */
    fill_attention(&a, q, k, v, got);
    memcpy(&old, &a, older);
    assert_int_equal(mha_attention_sized(&old, older), MHA_OK);
    assert_memory_equal(got, want, sizeof want);
    /* the same garbage inside the size is read, and refused */
    assert_int_not_equal(mha_attention_sized(&old, sizeof old), MHA_OK);
}

/* A newer program's struct: a zero tail runs, a set field is refused. */
typedef struct {
    mha_attention_args a;
    int64_t future[2];   /* fields of a newer mha.h */
} newer_args;

static void test_newer_attention_args(void **state)
{
    (void)state;
    float q[B * L * E], k[B * L * E], v[B * L * E];
    float want[B * L * E], got[B * L * E];
    tu_fill(q, B * L * E, 4, -1, 1);
    tu_fill(k, B * L * E, 5, -1, 1);
    tu_fill(v, B * L * E, 6, -1, 1);
    newer_args newer;
    memset(&newer, 0, sizeof newer);
    fill_attention(&newer.a, q, k, v, want);
    assert_int_equal(mha_attention(&newer.a), MHA_OK);
    newer.a.out = got;
    assert_int_equal(mha_attention_sized(&newer.a, sizeof newer), MHA_OK);
    assert_memory_equal(got, want, sizeof want);
    newer.future[1] = 3;
    memset(got, 0, sizeof got);
    assert_int_equal(mha_attention_sized(&newer.a, sizeof newer),
                     MHA_ERR_INVALID_ARGUMENT);
    const char *msg = mha_last_error();
    assert_non_null(strstr(msg, "mha_attention_args"));
    char byte[32];
    snprintf(byte, sizeof byte, "byte %zu",
             offsetof(newer_args, future) + sizeof(int64_t));
    assert_non_null(strstr(msg, byte));
    for (size_t i = 0; i < sizeof got / sizeof *got; i++)
        assert_true(got[i] == 0.0f);   /* refused before any work */
    assert_int_equal(mha_attention_sized(&newer.a, 0),
                     MHA_ERR_INVALID_ARGUMENT);
}

/* mha_config of a program from before grouped-query attention: the
 * fields past it (num_kv_heads, the modifiers, sinks) are defaults. */
static void test_older_config(void **state)
{
    (void)state;
    mha_config c;
    memset(&c, 0x7F, sizeof c);
    c.embed_dim = E;
    c.num_heads = H;
    c.kdim = c.vdim = 0;
    c.no_bias = c.add_bias_kv = c.add_zero_attn = 0;
    c.dropout = c.scale = 0.0f;
    c.seed = 9;
    c.head_dim = 0;
    c.given = 0;
    const size_t older = offsetof(mha_config, num_kv_heads);
    mha_module *m = NULL;
    assert_int_equal(mha_create_sized(&c, older, &m), MHA_OK);
    mha_config got;
    assert_int_equal(mha_get_config(m, &got), MHA_OK);
    assert_int_equal(got.num_kv_heads, H);
    assert_int_equal(got.v_head_dim, got.head_dim);
    assert_int_equal(got.sinks, 0);
    assert_int_equal(got.mods.window, 0);
    assert_int_equal(got.mods.rope.style, MHA_ROPE_NONE);

    /* Filled up to the caller's size: the bytes past it are untouched. */
    unsigned char buf[sizeof(mha_config) + 16];
    memset(buf, 0xAB, sizeof buf);
    assert_int_equal(mha_get_config_sized(m, (mha_config *)(void *)buf,
                                          older), MHA_OK);
    assert_memory_equal(buf, &got, older);
    for (size_t i = older; i < sizeof buf; i++)
        assert_int_equal(buf[i], 0xAB);
    mha_free(m);
}

/* mha_forward_args from before query slices: q_start and q_total past
 * its size are not read (garbage there would be refused). */
static void test_older_forward_args(void **state)
{
    (void)state;
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = H;
    mha_module *m = tu_module(&c, 3);
    assert_non_null(m);
    float x[B * L * E], want[B * L * E], got[B * L * E];
    tu_fill(x, B * L * E, 7, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.out = want;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    const size_t older = offsetof(mha_forward_args, q_start);
    mha_forward_args old;
    memset(&old, 0x33, sizeof old);
    a.out = got;
    memcpy(&old, &a, older);
    assert_int_equal(mha_forward_sized(m, &old, older), MHA_OK);
    assert_memory_equal(got, want, sizeof want);
    assert_int_not_equal(mha_forward_sized(m, &old, sizeof old), MHA_OK);
    mha_free(m);
}

/* mha_kv_cache_config from before sliding-window caches. */
static void test_older_cache_config(void **state)
{
    (void)state;
    mha_kv_cache_config cc;
    memset(&cc, 0x11, sizeof cc);
    cc.batch = B;
    cc.num_kv_heads = H;
    cc.head_dim = DH;
    cc.capacity = 16;
    cc.dtype = MHA_KV_F16;
    const size_t older = offsetof(mha_kv_cache_config, window);
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create_sized(&cc, older, &kv), MHA_OK);
    assert_int_equal(mha_kv_cache_length(kv, 0), 0);
    mha_kv_cache_free(kv);
    /* the window past the older size, read: 0x1111... is refused */
    assert_int_not_equal(mha_kv_cache_create_sized(&cc, sizeof cc, &kv),
                         MHA_OK);
    assert_null(kv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_older_attention_args),
        cmocka_unit_test(test_newer_attention_args),
        cmocka_unit_test(test_older_config),
        cmocka_unit_test(test_older_forward_args),
        cmocka_unit_test(test_older_cache_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
