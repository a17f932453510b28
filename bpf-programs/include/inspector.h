/* SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0 */
/*
 * Map layouts shared with user space (shim/src/inspector/bpf.rs mirrors them
 * with #[repr(C)] structs). Any change here is an ABI change: bump
 * ABI_VERSION in bpf.rs so that shims never open maps of another layout.
 */
#ifndef CRAB_INSPECTOR_H
#define CRAB_INSPECTOR_H

/* Same order as FsClass in bpf.rs. */
enum fs_class {
	FS_OPEN_WRITE,
	FS_WRITE,
	FS_TRUNCATE,
	FS_RENAME,
	FS_UNLINK,
	FS_MKDIR,
	FS_RMDIR,
	FS_LINK,
	FS_SYMLINK,
	FS_CHMOD,
	FS_CHOWN,
	FS_XATTR,
	FS_UTIMES,
	FS_MKNOD,
	FS_FALLOCATE,
	FS_COPY_RANGE,
	FS_MMAP_SHARED,
	FS_COREDUMP,
	FS_OTHER,
	/* A task outside every watched cgroup changed files of a container's
	 * rootfs (docker cp, a host tool chrooted or nsentered into it). */
	FS_OUTSIDE,
	FS_CLASSES
};

/* What a task did to kernel state outside the filesystem and outside its own
 * process that the inspector cannot compare: each makes the turn's processes
 * count as changed (a process checkpoint holds them). Same order as
 * StateClass in bpf/mod.rs. */
enum state_class {
	ST_PIDFD_GETFD,	  /* a copy of another process's file: anything may follow */
	ST_USERFAULTFD,	  /* ioctl(UFFDIO_*): fills pages of a (maybe other) process */
	ST_PTRACE_WRITE,  /* ptrace pokes and sets: memory, registers, sigmask */
	ST_OTHER_PROCESS, /* prlimit, setpriority, sched_set*, ioprio_set of pid != 0 */
	ST_SYSV_IPC,	  /* SysV message queues, semaphores, shared memory */
	ST_UTS,		  /* sethostname, setdomainname */
	ST_PROCFS,	  /* a write to a /proc file other than a process's mem */
	ST_ASYNC_IO,	  /* io_uring or AIO: operations without their own syscall */
	ST_TMPFS,	  /* a tmpfs or memfd file created or written: no upperdir holds it */
	STATE_CLASSES
};

/* Value of the per-CPU `watched` map, key = cgroup id (u64). Written by BPF
 * with atomic adds only; user space creates it zeroed on watch and sums the
 * CPUs' copies (the total of fs mutations is the sum of the classes). */
struct counters {
	__u64 fs_by_class[FS_CLASSES];
	__u64 shared_writable_mmaps;
	__u64 forks;   /* new processes */
	__u64 threads; /* new threads of existing processes */
	__u64 execs;
	__u64 exits;   /* processes (last thread) */
	__u64 foreign_mem_writes; /* ptrace, process_vm_writev, writes to /proc/PID/mem */
	__u64 state_by_class[STATE_CLASSES];
	__u64 errors;
	/* Run entries not made: the cgroup's `quotas` entry was used up. */
	__u64 over_quota;
	/* Owned by user space (same on every CPU), never touched by BPF: */
	__u64 level;        /* depth of the cgroup in the cgroup2 tree */
	__u64 misses_base;  /* programs' recursion misses at watch time */
};

/* Threads per process whose rseq area a `run` records. */
#define RUN_RSEQ_MAX 8

/* Value of the `runs` task storage: one per process, on its thread-group
 * leader (user space looks it up with a pidfd of the process). */
struct run {
	/* Times any thread of the process left a CPU, plus the boot-time clock
	 * (ns) when the entry was made: an entry made again for the same pid
	 * (an exec from another thread makes it the leader) never repeats a
	 * count the old one reported, since a switch-out takes more than 1 ns. */
	__u64 switches_out;
	__u64 cgroup_id;    /* watched cgroup it was last counted for */
	__u64 flags;        /* RUN_* */
	__u64 charged;      /* watched cgroup whose quota counts it, 0 = none */
	/* Signals queued to the process by anyone (another process, the kernel):
	 * one that stays pending is state its memory does not show. */
	__u64 signals;
	/* Syscalls of the process that returned while no tracer was attached
	 * (CRIU's parasite runs under ptrace), other than the few after which
	 * nobody outside the process can tell that it made them (quiet_syscall
	 * in inspector.bpf.c: waits that ended with no event, clocks, its own
	 * memory and signal set-up). Counted only while the `crab_quiet`
	 * program is attached (a shim whose config keeps self-contained
	 * changes attaches it): until then it does not move. Starts at the
	 * clock, as switches_out does. */
	__u64 interactions;
	/* User addresses of the rseq areas (struct rseq) of threads seen leaving a
	 * CPU: the kernel writes the current CPU there, which is no state of the
	 * process's own. Cleared at exec and whenever a thread exits (an area
	 * noted here belongs to a live thread of the current image); 0 = free. */
	__u64 rseq[RUN_RSEQ_MAX];
};

/* A 32-bit executable: its syscalls bypass the syscall tracepoints, so every
 * time it runs the cgroup gets an error ("everything may have changed"). */
#define RUN_COMPAT 1ULL
/* More threads ran than `rseq` has room for. */
#define RUN_RSEQ_MORE 2ULL

/* `oncpu` per-CPU array slot: ONCPU_VALID | tgid of the task switched in. */
#define ONCPU_VALID (1ULL << 32)

/* cgroup levels searched for a watched ancestor (containers that create
 * child cgroups are still covered). */
#define MAX_LEVELS 16

/* Value of the `quotas` map, key = watched cgroup id (u64): how many run
 * entries the cgroup's processes hold, and how many they may (the container's
 * `[limits] max_bpf_processes`). Written by user space at watch; `used` is
 * moved by BPF alone, with atomic adds. No entry: no bound. */
struct quota {
	__s64 used;
	__s64 max;
};

/* Filled by the shims alone (one entry per watched container), never by
 * what a container does. Per-process state lives in task storage, which has
 * no host-wide capacity for one container to exhaust. */
#define WATCHED_MAX 8192

#endif
