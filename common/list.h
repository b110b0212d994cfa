/* list.h - an intrusive doubly linked list, the one container the daemon's object graph uses. */
#ifndef EPD_COMMON_LIST_H
#define EPD_COMMON_LIST_H

#include <stddef.h>

struct epd_list {
        struct epd_list *prev, *next;
};

#define EPD_LIST_INIT(name) { &(name), &(name) }
#define epd_container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))
#define epd_list_entry(ptr, type, member) epd_container_of(ptr, type, member)
#define epd_list_for_each_safe(pos, tmp, head)                                               \
        for (pos = (head)->next, tmp = pos->next; pos != (head); pos = tmp, tmp = pos->next)
#define epd_list_for_each(pos, head) for (pos = (head)->next; pos != (head); pos = pos->next)

static inline void epd_list_init(struct epd_list *l)
{
        l->prev = l->next = l;
}

static inline int epd_list_empty(const struct epd_list *l)
{
        return l->next == l;
}

static inline void epd_list_add_tail(struct epd_list *head, struct epd_list *n)
{
        n->prev = head->prev;
        n->next = head;
        head->prev->next = n;
        head->prev = n;
}

static inline void epd_list_del(struct epd_list *n)
{
        n->prev->next = n->next;
        n->next->prev = n->prev;
        n->prev = n->next = n;
}

#endif
