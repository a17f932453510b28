/*
 * The pod infrastructure ("pause") container's process, built by
 * hack/build-images.sh into localhost/crab/pause so that CRI pods need no
 * registry. It behaves like Kubernetes' own pause: it holds the pod's
 * namespaces, reaps zombies when it is the pod's PID 1 (shared PID namespace),
 * and exits 0 on SIGINT or SIGTERM.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_exit_signal(int sig) {
  (void)sig;
  _exit(0);
}

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("pause (crab)");
    return 0;
  }
  if (getpid() != 1)
    fprintf(stderr, "pause: warning: not running as PID 1\n");

  struct sigaction exit_action = {.sa_handler = on_exit_signal};
  struct sigaction reap_action = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &exit_action, NULL) < 0 ||
      sigaction(SIGTERM, &exit_action, NULL) < 0 ||
      sigaction(SIGCHLD, &reap_action, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;)
    pause();
}
