/*
 * assert_error.h -- cmocka assertions on a failed libmha call: its status,
 * and that mha_last_error() names the problem.  Include after cmocka.h.
 */
#ifndef MHA_ASSERT_ERROR_H
#define MHA_ASSERT_ERROR_H

#include <string.h>

#include "mha.h"

/* Fails when the last error message does not contain `needle`. */
#define assert_msg_has(needle)                                              \
    do {                                                                    \
        const char *m_ = mha_last_error();                                  \
        assert_non_null(m_);                                                \
        if (!strstr(m_, (needle)))                                          \
            fail_msg("error message \"%s\" does not mention \"%s\"", m_,    \
                     (needle));                                             \
    } while (0)

/* Asserts the status and that the message names the problem. */
#define assert_fails(call, status, needle)                                  \
    do {                                                                    \
        mha_status st_ = (call);                                            \
        if (st_ != (status))                                                \
            fail_msg("%s returned %d (%s), expected %d; message: %s",       \
                     #call, (int)st_, mha_status_string(st_), (int)(status),\
                     mha_last_error());                                     \
        assert_msg_has(needle);                                             \
    } while (0)

#endif
