/*
 * The entrypoint of critest's nonewprivs image (hack/critest-images.sh), like
 * Kubernetes' test/images/nonewprivs: installed setuid root, started as uid
 * 1000, it prints the effective uid it got. "Effective uid: 0" means the
 * setuid bit took effect; "Effective uid: 1000" means no_new_privs blocked it.
 */
#include <stdio.h>
#include <unistd.h>

int main(void) {
  printf("Effective uid: %d\n", (int)geteuid());
  return fflush(stdout) == 0 ? 0 : 1;
}
