/* unit_log.c - the daemon logger's per call site rate limit: a repeated line is written at most
 * `burst` times a window, the rest are counted and reported in one line once the window ends,
 * debug lines and other call sites are not held back by a flood. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

/* Runs fn with stderr sent to a temporary file and returns what it wrote (malloc'd). */
static char *capture(void (*fn)(void))
{
        char path[] = "/tmp/epd-unit-log-XXXXXX";
        int fd = mkstemp(path), saved = dup(STDERR_FILENO);
        char *text;
        long len;
        FILE *f;

        ck_assert_int_ge(fd, 0);
        ck_assert_int_ge(saved, 0);
        ck_assert_int_ge(dup2(fd, STDERR_FILENO), 0);
        fn();
        ck_assert_int_ge(dup2(saved, STDERR_FILENO), 0);
        close(saved);
        f = fdopen(fd, "r");
        ck_assert_ptr_nonnull(f);
        fseek(f, 0, SEEK_END);
        len = ftell(f);
        rewind(f);
        text = calloc(1, (size_t)len + 1);
        ck_assert_int_eq(fread(text, 1, (size_t)len, f), (size_t)len);
        fclose(f);
        unlink(path);
        return text;
}

static int count(const char *text, const char *needle)
{
        int n = 0;
        for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle))
                n++;
        return n;
}

static void flood(void)
{
        epd_log_set_level(LOG_DEBUG);
        epd_log_set_rate(5, 200);
        for (int i = 0; i < 1000; i++) {
                log_warning("accept failed attempt=%d", i);
                if (i % 100 == 0)
                        log_info("another call site i=%d", i); /* 10 lines: 5 pass */
                if (i < 50)
                        log_debug("debug line i=%d", i);
        }
        /* The window ends; the flush reports what the flood lost. */
        usleep(250000);
        epd_log_flush_suppressed();
        log_warning("accept failed attempt=%d", 1000);
}

START_TEST(test_flood_is_limited_and_counted)
{
        char *text = capture(flood);

        /* Five of the flood, the one after the window; the report quotes the format. */
        ck_assert_int_eq(count(text, "accept failed attempt=") - count(text, "attempt=%d"), 5 + 1);
        ck_assert_msg(strstr(text, "accept failed attempt=1000") != NULL, "%s", text);
        ck_assert_msg(strstr(text, "995 similar lines suppressed") &&
                      strstr(text, "accept failed attempt=%d"),
                      "no report of the 995 suppressed lines:\n%s", text);
        ck_assert_int_eq(count(text, "another call site i=") - count(text, "i=%d"), 5);
        ck_assert_msg(strstr(text, "5 similar lines suppressed") != NULL,
                      "no report for the second call site:\n%s", text);
        /* Debug lines are not limited. */
        ck_assert_int_eq(count(text, "debug line i="), 50);
        free(text);
}
END_TEST

static void quiet(void)
{
        epd_log_set_level(LOG_INFO);
        epd_log_set_rate(5, 200);
        for (int i = 0; i < 5; i++)
                log_warning("quiet line %d", i);
        usleep(250000);
        epd_log_flush_suppressed();
        log_warning("quiet line %d", 5);
}

START_TEST(test_within_budget_nothing_is_suppressed)
{
        char *text = capture(quiet);

        ck_assert_int_eq(count(text, "quiet line "), 6);
        ck_assert_msg(strstr(text, "suppressed") == NULL, "a report without losses:\n%s", text);
        free(text);
}
END_TEST

int main(void)
{
        Suite *s = suite_create("log");
        TCase *tc = tcase_create("rate");
        SRunner *sr;
        int failed;

        tcase_add_test(tc, test_flood_is_limited_and_counted);
        tcase_add_test(tc, test_within_budget_nothing_is_suppressed);
        suite_add_tcase(s, tc);
        sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
