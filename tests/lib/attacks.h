/* attacks.h - what a careless or hostile tenant does to a shared daemon, each run in a child
 * process until it is stopped: the hostile-neighbour suite (integ_hostile) asserts that a
 * bystander group is unaffected, and epd-soak-hostile measures the bystander's latency beside
 * each attack. Where root runs them, the attacker drops to uid `nobody` (another user) when the
 * attack is about users; the daemon's socket must then be open to it (--socket-mode 0666 and a
 * traversable directory). */
#ifndef EPD_TEST_ATTACKS_H
#define EPD_TEST_ATTACKS_H

#include <sys/types.h>

#include "harness.h"

enum attack {
        ATTACK_NONE,          /* quiet: the bystander alone */
        ATTACK_STALL,         /* a 1-rank group's dispatch waits for inputs never marked ready */
        ATTACK_IDLE,          /* another uid keeps opening connections that never say Hello */
        ATTACK_WRONG_SECRET,  /* another uid guesses the bystander group's secret, reconnecting */
        ATTACK_BINDINGS,      /* another uid creates groups and rank bindings until refused */
        ATTACK_REGIONS,       /* another uid registers small regions until refused */
        ATTACK_COUNT,
};

const char *attack_name(enum attack a);
/* The attack's value of `name`, or -1. */
int attack_parse(const char *name);

struct attack_run {
        enum attack kind;
        pid_t pid;            /* the attacker, 0 for ATTACK_NONE */
        int ready_fd;         /* reads one byte once the attack is under way */
};

/* Starts the attack on d; `victim_group` is the bystander group's name. Returns once the
 * attacker reports that the attack is under way (0), or -1. */
int attack_start(struct attack_run *r, enum attack a, const struct h_daemon *d,
                 const char *victim_group);
/* 1 while the attacker still runs (the attack lasted), 0 if it ended by itself. */
int attack_active(const struct attack_run *r);
/* Kills the attacker and reaps it. */
void attack_stop(struct attack_run *r);

#endif
