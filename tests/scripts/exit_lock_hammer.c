/* Keeps the C library's exit-handler lock busy (tests/unit/test_exit_lock.py): registers handlers for a
   "library" of its own and runs them at once, over and over, until *stop is set (*rounds counts the rounds). A process forked from
   another thread meanwhile inherits the lock held, most of the time. */
extern int __cxa_atexit(void (*f)(void *), void *arg, void *d);
extern void __cxa_finalize(void *d);

static char token;

static void nothing(void *p) { (void)p; }

void hammer(volatile int *stop, volatile int *rounds) {
    while (!*stop) {
        for (int i = 0; i < 256; i++) __cxa_atexit(nothing, 0, &token);
        __cxa_finalize(&token);
        *rounds += 1;
    }
}
