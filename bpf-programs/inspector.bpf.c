// SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0
/*
 * crab inspector: per-cgroup counters of what the tasks of watched cgroups do
 * that can leave state behind (filesystem mutations, processes, scheduling).
 *
 * Loaded once per host and shared by every shim through bpffs pins; a shim
 * only adds its container's cgroup id to `watched`. Every program starts with
 * one hash lookup keyed by the current cgroup id, so the cost of a syscall
 * does not depend on how many cgroups are watched. Tracepoints only: fentry,
 * fexit and lsm are refused on the target hosts and kprobes are absent.
 *
 * Counting is deliberately conservative: whenever a program cannot tell (a
 * read of kernel or user memory failed, a map was full), it counts the event
 * or records an error, never drops it. A missed mutation would be a broken
 * recovery; an extra one only costs a cheap user-space comparison.
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>

#include "kernel.h"
#include "inspector.h"

char LICENSE[] SEC("license") = "GPL";

/* Per CPU: counting never bounces a cache line between CPUs, however many
 * threads a container runs in parallel. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, WATCHED_MAX);
	/* Elements are freed after an RCU grace period, so a program that
	 * looked one up just before unwatch never writes into a recycled
	 * element that already belongs to another cgroup. */
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct counters);
} watched SEC(".maps");

/* Bit L set = some watched cgroup is at level L (user space maintains it). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} levels SEC(".maps");

/*
 * Run counts, per process: task storage of its thread-group leader, so an
 * entry lives and dies with its process and takes room from no shared table
 * (a container with many processes once filled a host-wide hash and made
 * every neighbour's turns degraded). Memory is charged to the memory cgroup
 * of the shim that loaded the programs, about 150 bytes per process of a
 * watched container (a process costs its own cgroup over 10 KiB of kernel
 * memory: the container's pids and memory limits bound it).
 */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct run);
} runs SEC(".maps");

/* Per watched cgroup: run entries held and allowed (struct quota). Bounds the
 * kernel memory one container's processes make the programs hold, which is
 * charged to the loading shim, not to the container. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, WATCHED_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct quota);
} quotas SEC(".maps");

/* Which process each CPU is running (ONCPU_VALID | tgid), for every task on
 * the host: a process on a CPU right now may be changing its memory even
 * though its switch-out count has not moved yet. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} oncpu SEC(".maps");

/*
 * Container rootfs superblocks: key = the overlay's s_dev (the kernel's
 * encoding, major << 20 | minor), value = the watched cgroup id of the
 * container running on it. Filled by the shims alone. A task outside every
 * watched cgroup that changes files there (dockerd's `docker cp`, a host tool
 * chrooted or nsentered into the rootfs, a writer through the rootfs's host
 * path) counts for that container as FS_OUTSIDE: the next turn end then
 * scans the upperdir, which shows what changed.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, WATCHED_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, __u64);
} rootfs SEC(".maps");

/* 1 once any shim registered a rootfs (never cleared: no race between shims
 * registering and removing). Until then a task outside every watched cgroup
 * pays one array lookup more, and nothing else. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} rootfs_any SEC(".maps");

/* Layout of syscall tracepoint records (stable tracepoint ABI). */
struct sys_enter {
	__u64 common;
	__s32 nr;
	__u32 pad;
	__u64 args[6];
};

struct sys_exit {
	__u64 common;
	__s32 nr;
	__u32 pad;
	__s64 ret;
};

#define O_WRONLY 01
#define O_RDWR 02
#define O_CREAT 0100
#define O_TRUNC 01000
#define __O_TMPFILE 020000000
#define OPEN_MUTATING (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | __O_TMPFILE)

#define S_IFMT 0170000
#define S_IFSOCK 0140000
#define S_IFREG 0100000
#define S_IFBLK 0060000
#define S_IFCHR 0020000
#define S_IFIFO 0010000

#define PROC_SUPER_MAGIC 0x9fa0
#define TMPFS_MAGIC 0x01021994
#define PF_EXITING 0x00000004
#define AT_REMOVEDIR 0x200
#define AF_UNIX 1

#define PROT_WRITE 0x2
#define MAP_TYPE 0x0f
#define MAP_SHARED 0x01
#define MAP_SHARED_VALIDATE 0x03
#define MAP_ANONYMOUS 0x20
#define VM_SHARED 0x00000008

#define ENOENT 2
#define ENXIO 6
#define EBADF 9
#define EFAULT 14
#define EEXIST 17
#define ENOTDIR 20
#define EISDIR 21
#define EROFS 30
#define ENAMETOOLONG 36
#define ELOOP 40

/* fd_mode() results besides an inode mode. */
#define FD_NONE (-1)	/* no such fd: the syscall fails with EBADF */
#define FD_UNKNOWN (-2) /* could not read: assume the worst */

/* Atomic even on per-CPU values: a program preempted mid-update (faultable
 * syscall tracepoints) must not lose another's increment. Uncontended, so
 * cheap. */
static __always_inline void add(__u64 *counter)
{
	__sync_fetch_and_add(counter, 1);
}

static __always_inline struct counters *lookup_watched(__u64 id, __u64 *matched)
{
	struct counters *c = bpf_map_lookup_elem(&watched, &id);

	if (c)
		*matched = id;
	return c;
}

static __always_inline __u64 watched_levels(void)
{
	__u32 zero = 0;
	__u64 *mask = bpf_map_lookup_elem(&levels, &zero);

	return mask ? *mask : 0;
}

/*
 * Counters of the watched cgroup the current task belongs to: its own cgroup
 * or, for containers that made child cgroups, the watched ancestor. Costs one
 * hash lookup for unwatched tasks unless some watched cgroup sits above the
 * task's level; never a walk over the watched set.
 */
static __always_inline struct counters *current_counters(__u64 *matched)
{
	__u64 id = bpf_get_current_cgroup_id();
	struct counters *c = lookup_watched(id, matched);
	__u64 mask;

	if (c)
		return c;
	mask = watched_levels();
	if (!mask)
		return NULL;
	for (int level = 1; level < MAX_LEVELS; level++) {
		__u64 ancestor;

		if (!(mask & (1ULL << level)))
			continue;
		ancestor = bpf_get_current_ancestor_cgroup_id(level);
		if (!ancestor || ancestor == id)
			break; /* the task is not deeper than this level */
		c = lookup_watched(ancestor, matched);
		if (c)
			return c;
	}
	return NULL;
}

/* Same as current_counters() for another task (a freshly forked child can sit
 * in another cgroup than its parent: clone3 with CLONE_INTO_CGROUP). */
static __always_inline struct counters *task_counters(struct task_struct *task, __u64 *matched)
{
	struct cgroup *cgrp = BPF_CORE_READ(task, cgroups, dfl_cgrp);
	struct counters *c;
	__u64 mask;
	int depth;

	if (!cgrp)
		return NULL;
	c = lookup_watched(BPF_CORE_READ(cgrp, kn, id), matched);
	if (c)
		return c;
	mask = watched_levels();
	if (!mask)
		return NULL;
	depth = BPF_CORE_READ(cgrp, level);
	for (int level = 1; level < MAX_LEVELS; level++) {
		struct cgroup *ancestor = NULL;

		if (level >= depth)
			break;
		if (!(mask & (1ULL << level)))
			continue;
		if (bpf_core_read(&ancestor, sizeof(ancestor), &cgrp->ancestors[level]) || !ancestor)
			continue;
		c = lookup_watched(BPF_CORE_READ(ancestor, kn, id), matched);
		if (c)
			return c;
	}
	return NULL;
}

static __always_inline void count_fs(struct counters *c, int class)
{
	add(&c->fs_by_class[class]);
}

static __always_inline int rootfs_registered(void)
{
	__u32 zero = 0;
	__u64 *any = bpf_map_lookup_elem(&rootfs_any, &zero);

	return any && *any;
}

/* Counters of the watched container whose rootfs is superblock `sb`. */
static __always_inline struct counters *rootfs_counters(struct super_block *sb, __u64 *matched)
{
	__u64 dev, *cg;

	if (!sb)
		return NULL;
	dev = BPF_CORE_READ(sb, s_dev);
	cg = bpf_map_lookup_elem(&rootfs, &dev);
	return cg ? lookup_watched(*cg, matched) : NULL;
}

/*
 * For a task outside every watched cgroup making a path-based change: the
 * container whose rootfs is the task's root (a chroot into it, its mount
 * namespace entered: how `docker cp` writes) or its working directory, for
 * absolute and relative paths alike. Counts a change that lands elsewhere
 * too (a scan more, never a miss); a host path into the rootfs from outside
 * both (`/var/lib/docker/.../merged/x`) is seen only when it writes through
 * an fd (outside_fd_counters).
 */
static __always_inline struct counters *outside_counters(__u64 *matched)
{
	struct task_struct *task;
	struct counters *c;

	if (!rootfs_registered())
		return NULL;
	task = bpf_get_current_task_btf();
	c = rootfs_counters(BPF_CORE_READ(task, fs, root.dentry, d_sb), matched);
	if (c)
		return c;
	return rootfs_counters(BPF_CORE_READ(task, fs, pwd.dentry, d_sb), matched);
}

/* The superblock of the file behind fd of the current task, NULL if none. */
static __always_inline struct super_block *fd_sb(int fd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct fdtable *fdt;
	struct file *file = NULL;

	if (fd < 0)
		return NULL;
	fdt = task->files->fdt;
	if (!fdt || (unsigned int)fd >= fdt->max_fds)
		return NULL;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fdt->fd[fd]) || !file)
		return NULL;
	return BPF_CORE_READ(file, f_inode, i_sb);
}

/* For a task outside every watched cgroup writing through fd: the container
 * whose rootfs holds the file, whatever path opened it. */
static __always_inline struct counters *outside_fd_counters(int fd, __u64 *matched)
{
	if (!rootfs_registered())
		return NULL;
	return rootfs_counters(fd_sb(fd), matched);
}

/*
 * Inode mode behind an fd of the current task (task->files->fdt->fd[fd]).
 * The BTF-typed current task makes the walk down to the fd array plain,
 * fault-safe loads; the file and inode are behind a pointer array, which the
 * verifier does not type, so they take probe reads.
 */
static __always_inline __s64 fd_mode(int fd, unsigned long *magic)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct fdtable *fdt;
	struct file **fds;
	struct file *file = NULL;
	struct inode *inode;
	unsigned short mode;

	if (fd < 0)
		return FD_NONE;
	fdt = task->files->fdt;
	if (!fdt)
		return FD_UNKNOWN;
	if ((unsigned int)fd >= fdt->max_fds)
		return FD_NONE;
	fds = fdt->fd;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]))
		return FD_UNKNOWN;
	if (!file)
		return FD_NONE;
	inode = BPF_CORE_READ(file, f_inode);
	if (!inode || bpf_core_read(&mode, sizeof(mode), &inode->i_mode))
		return FD_UNKNOWN;
	if (magic && (mode & S_IFMT) == S_IFREG)
		*magic = BPF_CORE_READ(inode, i_sb, s_magic);
	return mode;
}

static __always_inline void count_state(struct counters *c, int class)
{
	add(&c->state_by_class[class]);
}

/* Whether fd of the current task is a file named "mem" (of procfs: the
 * caller checked the magic). Unreadable counts as "mem" only if the caller
 * also counts the other case: here it does not, so unreadable is "not mem"
 * and the write counts as kernel state, the conservative side. */
static __always_inline int proc_file_is_mem(int fd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct fdtable *fdt = task->files->fdt;
	struct file *file = NULL;
	const unsigned char *name;
	char buf[4] = {};

	if (!fdt || (unsigned int)fd >= fdt->max_fds)
		return 0;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fdt->fd[fd]) || !file)
		return 0;
	name = BPF_CORE_READ(file, f_path.dentry, d_name.name);
	if (!name || bpf_probe_read_kernel_str(buf, sizeof(buf), name) != 4)
		return 0;
	return buf[0] == 'm' && buf[1] == 'e' && buf[2] == 'm';
}

static __always_inline int count_state_simple(int class)
{
	__u64 cg;
	struct counters *c = current_counters(&cg);

	if (c)
		count_state(c, class);
	return 0;
}

static __always_inline int count_simple(int class)
{
	__u64 cg;
	struct counters *c = current_counters(&cg);

	if (c)
		count_fs(c, class);
	else if ((c = outside_counters(&cg)))
		count_fs(c, FS_OUTSIDE);
	return 0;
}

#define SIMPLE(name, class)                      \
	SEC("tracepoint")                        \
	int name(void *ctx)                      \
	{                                        \
		return count_simple(class);      \
	}

SIMPLE(crab_truncate, FS_TRUNCATE)
SIMPLE(crab_rename, FS_RENAME)
SIMPLE(crab_unlink, FS_UNLINK)
SIMPLE(crab_rmdir, FS_RMDIR)
SIMPLE(crab_mkdir, FS_MKDIR)
SIMPLE(crab_link, FS_LINK)
SIMPLE(crab_symlink, FS_SYMLINK)
SIMPLE(crab_chmod, FS_CHMOD)
SIMPLE(crab_chown, FS_CHOWN)
SIMPLE(crab_xattr, FS_XATTR)
SIMPLE(crab_utimes, FS_UTIMES)
SIMPLE(crab_mknod, FS_MKNOD)
SIMPLE(crab_fallocate, FS_FALLOCATE)
SIMPLE(crab_copy_range, FS_COPY_RANGE)
/* io_uring and AIO can write files without a write syscall, and io_uring
 * can reach other processes' state by operations of its own (a write to
 * /proc/PID/mem, a send): any use counts as both. */
SEC("tracepoint")
int crab_async_io(void *ctx)
{
	__u64 cg;
	struct counters *c = current_counters(&cg);

	if (c) {
		count_fs(c, FS_OTHER);
		count_state(c, ST_ASYNC_IO);
	}
	return 0;
}

/* Kernel state outside any process's memory, or another process's, that a
 * turn end does not compare: each use counts. */
SEC("tracepoint")
int crab_pidfd_getfd(void *ctx)
{
	return count_state_simple(ST_PIDFD_GETFD);
}

SEC("tracepoint")
int crab_sysv_ipc(void *ctx)
{
	return count_state_simple(ST_SYSV_IPC);
}

SEC("tracepoint")
int crab_uts(void *ctx)
{
	return count_state_simple(ST_UTS);
}

/* prlimit64(pid, resource, new, old): only setting another's limits. */
SEC("tracepoint")
int crab_prlimit(struct sys_enter *ctx)
{
	if ((int)ctx->args[0] == 0 || !ctx->args[2])
		return 0;
	return count_state_simple(ST_OTHER_PROCESS);
}

/* setpriority(which, who, prio), ioprio_set(which, who, prio): who == 0 is the
 * caller (or its group, its user: counted too when not 0). */
SEC("tracepoint")
int crab_set_who(struct sys_enter *ctx)
{
	if ((int)ctx->args[1] == 0)
		return 0;
	return count_state_simple(ST_OTHER_PROCESS);
}

/* sched_setscheduler, sched_setparam, sched_setattr, sched_setaffinity:
 * pid first, 0 = the caller. */
SEC("tracepoint")
int crab_set_pid(struct sys_enter *ctx)
{
	if ((int)ctx->args[0] == 0)
		return 0;
	return count_state_simple(ST_OTHER_PROCESS);
}

SEC("tracepoint")
int crab_unlinkat(struct sys_enter *ctx)
{
	return count_simple(ctx->args[2] & AT_REMOVEDIR ? FS_RMDIR : FS_UNLINK);
}

/* write family: only regular files change the filesystem; stdout, pipes,
 * sockets, ttys, eventfds do not. Writes to /proc files change processes,
 * not files (e.g. /proc/PID/mem). */
static __always_inline int count_write_fd(int fd)
{
	__u64 cg;
	struct counters *c = current_counters(&cg);
	unsigned long magic = 0;
	__s64 mode;

	if (!c) {
		c = outside_fd_counters(fd, &cg);
		if (c)
			count_fs(c, FS_OUTSIDE);
		return 0;
	}
	mode = fd_mode(fd, &magic);
	if (mode == FD_NONE)
		return 0;
	if (mode != FD_UNKNOWN && (mode & S_IFMT) != S_IFREG)
		return 0;
	if (mode != FD_UNKNOWN && magic == PROC_SUPER_MAGIC) {
		/* /proc/PID/mem changes memory, which the turn end compares;
		 * any other /proc file (oom_score_adj, sysctls, ...) changes
		 * kernel state it does not. */
		if (proc_file_is_mem(fd))
			add(&c->foreign_mem_writes);
		else
			count_state(c, ST_PROCFS);
		return 0;
	}
	/* A tmpfs mount of the container (/dev/shm, /dev, a --tmpfs) or a
	 * memfd: no upperdir holds it, a process checkpoint does. */
	if (mode != FD_UNKNOWN && magic == TMPFS_MAGIC)
		count_state(c, ST_TMPFS);
	count_fs(c, FS_WRITE);
	return 0;
}

/* write, pwrite64, writev, pwritev, pwritev2, sendfile64: fd is argument 0 */
SEC("tracepoint")
int crab_write(struct sys_enter *ctx)
{
	return count_write_fd((int)ctx->args[0]);
}

SEC("tracepoint")
int crab_splice(struct sys_enter *ctx)
{
	return count_write_fd((int)ctx->args[2]);
}

/* Errors after which a create/truncate open certainly changed nothing. */
static __always_inline int open_failed_cleanly(__s64 err)
{
	switch (-err) {
	case ENOENT:
	case ENXIO:
	case EBADF:
	case EFAULT:
	case EEXIST:
	case ENOTDIR:
	case EISDIR:
	case EROFS:
	case ENAMETOOLONG:
	case ELOOP:
		return 1;
	}
	return 0;
}

enum open_kind { OPEN, OPENAT, OPENAT2, CREAT };

static __always_inline __u64 open_flags(struct pt_regs___crab *regs, enum open_kind kind)
{
	__u64 flags;

	switch (kind) {
	case OPEN:
		return SYSCALL_ARG1(regs);
	case OPENAT:
		return SYSCALL_ARG2(regs);
	case OPENAT2: /* struct open_how starts with __u64 flags */
		if (bpf_probe_read_user(&flags, sizeof(flags), (void *)SYSCALL_ARG2(regs)))
			return OPEN_MUTATING;
		return flags;
	default:
		return O_CREAT | O_WRONLY | O_TRUNC;
	}
}

/* An open by a task outside every watched cgroup: a mutating open of a file
 * on a container's rootfs counts for it; a failed create, for the rootfs the
 * task works in (outside_counters). */
static __always_inline int outside_open_exit(struct sys_exit *ctx, enum open_kind kind)
{
	struct pt_regs___crab *regs;
	struct counters *c;
	__u64 flags, cg;

	if (!rootfs_registered())
		return 0;
	regs = (struct pt_regs___crab *)bpf_task_pt_regs(bpf_get_current_task_btf());
	flags = open_flags(regs, kind);
	if (!(flags & OPEN_MUTATING))
		return 0;
	if (ctx->ret >= 0)
		c = rootfs_counters(fd_sb((int)ctx->ret), &cg);
	else if ((flags & (O_CREAT | O_TRUNC | __O_TMPFILE)) && !open_failed_cleanly(ctx->ret))
		c = outside_counters(&cg);
	else
		c = NULL;
	if (c)
		count_fs(c, FS_OUTSIDE);
	return 0;
}

/*
 * open family, decided at sys_exit, when the result is known: only modes
 * that can change something (write, create, truncate, tmpfile), and not when
 * the file opened is a device, FIFO or socket (every `2>/dev/null`). The
 * syscall's arguments are still in the task's saved user registers.
 */
static __always_inline int open_exit(struct sys_exit *ctx, enum open_kind kind)
{
	struct pt_regs___crab *regs;
	struct counters *c;
	__s64 ret = ctx->ret;
	__u64 flags, cg;

	c = current_counters(&cg);
	if (!c)
		return outside_open_exit(ctx, kind);
	regs = (struct pt_regs___crab *)bpf_task_pt_regs(bpf_get_current_task_btf());
	flags = open_flags(regs, kind);
	if (!(flags & OPEN_MUTATING))
		return 0;
	if (ret >= 0) {
		unsigned long magic = 0;
		__s64 mode = fd_mode((int)ret, &magic);

		if (mode >= 0) {
			__u32 fmt = mode & S_IFMT;

			if (fmt == S_IFCHR || fmt == S_IFIFO || fmt == S_IFSOCK || fmt == S_IFBLK)
				return 0;
			/* Created or truncated on a tmpfs: see count_write_fd. */
			if (magic == TMPFS_MAGIC && (flags & (O_CREAT | O_TRUNC | __O_TMPFILE)))
				count_state(c, ST_TMPFS);
		}
		count_fs(c, FS_OPEN_WRITE);
		return 0;
	}
	/* A failed open may still have created the file (the create succeeds,
	 * a later step such as an LSM check fails). */
	if ((flags & (O_CREAT | O_TRUNC | __O_TMPFILE)) && !open_failed_cleanly(ret))
		count_fs(c, FS_OPEN_WRITE);
	return 0;
}

SEC("tracepoint")
int crab_open_x(struct sys_exit *ctx)
{
	return open_exit(ctx, OPEN);
}

SEC("tracepoint")
int crab_openat_x(struct sys_exit *ctx)
{
	return open_exit(ctx, OPENAT);
}

SEC("tracepoint")
int crab_openat2_x(struct sys_exit *ctx)
{
	return open_exit(ctx, OPENAT2);
}

SEC("tracepoint")
int crab_creat_x(struct sys_exit *ctx)
{
	return open_exit(ctx, CREAT);
}

/* Rare (needs CAP_DAC_READ_SEARCH) and cannot create: decided at entry. */
SEC("tracepoint")
int crab_open_handle(struct sys_enter *ctx)
{
	if (!(ctx->args[2] & OPEN_MUTATING))
		return 0;
	return count_simple(FS_OPEN_WRITE);
}

/* FICLONE & co. modify files through ioctl(2); everything else is ignored. */
SEC("tracepoint")
int crab_ioctl(struct sys_enter *ctx)
{
	switch ((__u32)ctx->args[1]) {
	case 0x40049409: /* FICLONE */
	case 0x4020940d: /* FICLONERANGE */
	case 0xc0189436: /* FIDEDUPERANGE */
	case 0x40086602: /* FS_IOC_SETFLAGS */
	case 0x40046602: /* FS_IOC32_SETFLAGS */
	case 0x401c5820: /* FS_IOC_FSSETXATTR */
	case 0x40305828: /* FS_IOC_RESVSP */
	case 0x4030582a: /* FS_IOC_RESVSP64 */
	case 0x4030582b: /* FS_IOC_UNRESVSP64 */
	case 0x4030583f: /* FS_IOC_ZERO_RANGE */
		return count_simple(FS_OTHER);
	}
	/* UFFDIO_COPY & co. fill pages of whichever process registered the
	 * range: ioctl type 0xAA. */
	if ((((__u32)ctx->args[1] >> 8) & 0xff) == 0xAA)
		return count_state_simple(ST_USERFAULTFD);
	return 0;
}

/* bind(2) of a unix socket to a path creates a socket file. */
SEC("tracepoint")
int crab_bind(struct sys_enter *ctx)
{
	struct {
		__u16 family;
		char first;
	} addr;
	__u64 cg;
	struct counters *c;

	if ((int)ctx->args[2] <= 2) /* family only: autobind, nothing on disk */
		return 0;
	c = current_counters(&cg);
	if (!c)
		return 0;
	if (bpf_probe_read_user(&addr, 3, (void *)ctx->args[1]) == 0 &&
	    (addr.family != AF_UNIX || addr.first == 0))
		return 0; /* not unix, or abstract namespace */
	count_fs(c, FS_MKNOD);
	return 0;
}

static __always_inline void count_shared_mmap(struct counters *c)
{
	count_fs(c, FS_MMAP_SHARED);
	add(&c->shared_writable_mmaps);
}

/* A shared writable file mapping lets the process change the file later
 * without any syscall. */
SEC("tracepoint")
int crab_mmap(struct sys_enter *ctx)
{
	__u64 prot = ctx->args[2], flags = ctx->args[3];
	int fd = (int)ctx->args[4];
	__u64 type = flags & MAP_TYPE;
	struct counters *c;
	__s64 mode;
	__u64 cg;

	if (!(prot & PROT_WRITE) || (type != MAP_SHARED && type != MAP_SHARED_VALIDATE) ||
	    (flags & MAP_ANONYMOUS) || fd < 0)
		return 0;
	c = current_counters(&cg);
	if (!c)
		return 0;
	mode = fd_mode(fd, NULL);
	if (mode == FD_NONE || (mode >= 0 && (mode & S_IFMT) != S_IFREG))
		return 0; /* fails, or a device such as /dev/zero */
	count_shared_mmap(c);
	return 0;
}

struct vma_probe {
	__u64 end;
	int shared_file;
};

static long vma_probe_cb(struct task_struct *task, struct vm_area_struct *vma, void *data)
{
	struct vma_probe *probe = data;

	probe->end = vma->vm_end;
	probe->shared_file = (vma->vm_flags & VM_SHARED) && vma->vm_file;
	return 0;
}

/* mprotect(PROT_WRITE) can turn a read-only shared file mapping writable. */
SEC("tracepoint")
int crab_mprotect(struct sys_enter *ctx)
{
	__u64 start = ctx->args[0], len = ctx->args[1], prot = ctx->args[2];
	struct vma_probe probe = {};
	struct counters *c;
	long err;
	__u64 cg;

	if (!(prot & PROT_WRITE))
		return 0;
	c = current_counters(&cg);
	if (!c)
		return 0;
	err = bpf_find_vma(bpf_get_current_task_btf(), start, vma_probe_cb, &probe, 0);
	if (err == -ENOENT)
		return 0; /* nothing mapped there: mprotect fails */
	/* -EBUSY (mmap lock contended) or a range over several mappings: the
	 * first one tells nothing about the others. */
	if (err || probe.shared_file || probe.end < start + len)
		count_shared_mmap(c);
	return 0;
}

/* ptrace requests that change a tracee other than through its memory:
 * registers, signal mask and siginfo, thread area, fs/gs base. Pokes change
 * memory but count here too: gdb's breakpoints go with register edits. */
static __always_inline int ptrace_writes(long request)
{
	switch (request) {
	case 4:	     /* PTRACE_POKETEXT */
	case 5:	     /* PTRACE_POKEDATA */
	case 6:	     /* PTRACE_POKEUSR */
	case 13:     /* PTRACE_SETREGS */
	case 15:     /* PTRACE_SETFPREGS */
	case 19:     /* PTRACE_SETFPXREGS */
	case 26:     /* PTRACE_SET_THREAD_AREA */
	case 30:     /* PTRACE_ARCH_PRCTL */
	case 0x4203: /* PTRACE_SETSIGINFO */
	case 0x4205: /* PTRACE_SETREGSET */
	case 0x420b: /* PTRACE_SETSIGMASK */
	case 0x4210: /* PTRACE_SET_SYSCALL_USER_DISPATCH_CONFIG */
	case 0x4212: /* PTRACE_SET_SYSCALL_INFO */
		return 1;
	}
	return 0;
}

SEC("tracepoint")
int crab_ptrace(struct sys_enter *ctx)
{
	__u64 cg;
	struct counters *c = current_counters(&cg);

	if (!c)
		return 0;
	add(&c->foreign_mem_writes);
	if (ptrace_writes((long)ctx->args[0]))
		count_state(c, ST_PTRACE_WRITE);
	return 0;
}

/* process_vm_writev changes another process's memory without that process
 * running: its run count alone would miss it. */
SEC("tracepoint")
int crab_foreign(void *ctx)
{
	__u64 cg;
	struct counters *c = current_counters(&cg);

	if (c)
		add(&c->foreign_mem_writes);
	return 0;
}

/* The entry of the process `t` belongs to, if it has one. */
static __always_inline struct run *run_of(struct task_struct *t)
{
	return bpf_task_storage_get(&runs, t->group_leader, 0, 0);
}

/*
 * Makes the entry of process `t` of watched cgroup `cg` (counters `c`),
 * within the cgroup's quota; returns it (or the one another CPU made
 * meanwhile), NULL when none could be made: the quota is used up (counted in
 * `over_quota`: the cgroup's own turns are then DEGRADED, nobody else's), or
 * the kernel's per-CPU storage lock is held by a preempted holder (an error).
 * A fresh entry starts at the clock (see struct run).
 */
static __always_inline struct run *run_make(struct task_struct *t, __u64 cg, struct counters *c)
{
	struct quota *q = bpf_map_lookup_elem(&quotas, &cg);
	struct run *run;

	if (q && __sync_fetch_and_add(&q->used, 1) >= q->max) {
		__sync_fetch_and_add(&q->used, -1);
		add(&c->over_quota);
		return NULL;
	}
	run = bpf_task_storage_get(&runs, t->group_leader, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!run)
		run = run_of(t); /* made meanwhile on another CPU? */
	if (!run) {
		if (q)
			__sync_fetch_and_add(&q->used, -1);
		add(&c->errors); /* user space must not trust run counts */
		return NULL;
	}
	/* Charged once: whoever sets `charged` keeps its count, others give it back. */
	if (q && __sync_val_compare_and_swap(&run->charged, 0, cg) != 0)
		__sync_fetch_and_add(&q->used, -1);
	/* Two CPUs may both see it fresh: the count then jumps twice, which only
	 * says "ran". */
	if (!run->switches_out)
		__sync_fetch_and_add(&run->switches_out, bpf_ktime_get_ns());
	/* Likewise: an entry made again (an exec from another thread) never
	 * repeats an interactions count the old one reported. */
	if (!run->interactions)
		__sync_fetch_and_add(&run->interactions, bpf_ktime_get_ns());
	return run;
}

/* Gives back the quota an entry holds (the process exits, or its entry is
 * dropped). */
static __always_inline void run_uncharge(struct run *run)
{
	__u64 cg = run->charged;
	struct quota *q;

	if (!cg || __sync_val_compare_and_swap(&run->charged, cg, 0) != cg)
		return;
	q = bpf_map_lookup_elem(&quotas, &cg);
	if (q)
		__sync_fetch_and_add(&q->used, -1);
}

/* The user address of task `t`'s rseq area, 0 if none (or unknown). */
static __always_inline __u64 task_rseq(struct task_struct *t)
{
	struct task_struct___rseq_ptr *r = (void *)t;

	if (!bpf_core_field_exists(r->rseq))
		return 0;
	return (__u64)BPF_CORE_READ(r, rseq);
}

/* Notes the rseq area of `t` (a thread of run's process leaving a CPU). Two
 * CPUs may race for a free slot: the loser's area is noted at its next
 * switch-out. */
static __always_inline void note_rseq(struct run *run, struct task_struct *t)
{
	__u64 p = task_rseq(t);
	int i;

	if (!p)
		return;
	for (i = 0; i < RUN_RSEQ_MAX; i++) {
		__u64 cur = run->rseq[i];

		if (cur == p)
			return;
		if (!cur) {
			run->rseq[i] = p;
			return;
		}
	}
	__sync_fetch_and_or(&run->flags, RUN_RSEQ_MORE);
}

static __always_inline void forget_rseq(struct run *run)
{
	int i;

	for (i = 0; i < RUN_RSEQ_MAX; i++)
		run->rseq[i] = 0;
	__sync_fetch_and_and(&run->flags, ~RUN_RSEQ_MORE);
}

/* Forgets the area of thread `t` alone (it exits, or unregisters it): the
 * other threads' areas stay noted though they may not run again for long.
 * All of them when its area cannot be read. */
static __always_inline void unnote_rseq(struct run *run, struct task_struct *t)
{
	__u64 p = task_rseq(t);
	int i;

	if (!p) {
		forget_rseq(run);
		return;
	}
	for (i = 0; i < RUN_RSEQ_MAX; i++) {
		if (run->rseq[i] == p)
			run->rseq[i] = 0;
	}
}

/* rseq(2) with RSEQ_FLAG_UNREGISTER (args: rseq, len, flags, sig): the
 * thread's area stops being one (the kernel no longer writes it, and the
 * thread may keep data there). Registrations are noted at switch-out. */
SEC("tracepoint")
int crab_rseq(struct sys_enter *ctx)
{
	struct task_struct *task;
	struct run *run;
	__u64 cg;

	if (!(ctx->args[2] & 1 /* RSEQ_FLAG_UNREGISTER */) || !current_counters(&cg))
		return 0;
	task = bpf_get_current_task_btf();
	run = run_of(task);
	if (run)
		unnote_rseq(run, task);
	return 0;
}

/*
 * On x86-64, syscalls of 32-bit processes (int 0x80, sysenter) do not reach
 * the syscall tracepoints: such a process is marked so that each of its runs
 * is an error for its cgroup (the turn is then "everything changed").
 */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(crab_exec, struct task_struct *task, int old_pid, struct linux_binprm *bprm)
{
	struct run *run;
	struct counters *c;
	unsigned char ident[5];
	__u64 cg;

	c = current_counters(&cg);
	if (!c)
		return 0;
	add(&c->execs);
	/* A new image: the old areas are no rseq areas any more. */
	run = run_of(task);
	if (run)
		forget_rseq(run);
	if (bpf_core_read(ident, sizeof(ident), &bprm->buf)) {
		add(&c->errors);
		return 0;
	}
	/* ELF magic, EI_CLASS == ELFCLASS32 */
	if (ident[0] != 0x7f || ident[1] != 'E' || ident[2] != 'L' || ident[3] != 'F' || ident[4] != 1)
		return 0;
	add(&c->errors);
	if (!run)
		run = run_make(task, cg, c);
	if (run) {
		run->cgroup_id = cg;
		__sync_fetch_and_or(&run->flags, RUN_COMPAT);
	}
	return 0;
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(crab_fork, struct task_struct *parent, struct task_struct *child)
{
	__u64 cg;
	struct counters *c = task_counters(child, &cg);

	if (!c)
		return 0;
	if (child->pid == child->tgid)
		add(&c->forks);
	else
		add(&c->threads);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(crab_exit, struct task_struct *task)
{
	struct run *run;
	struct counters *c;
	__u64 cg;

	/* signal->live was decremented before this tracepoint: 0 = last thread */
	if (BPF_CORE_READ(task, signal, live.counter) != 0) {
		/* A thread exits: its area may be freed and reused for data. Its
		 * last switch-outs (PF_EXITING) note nothing. */
		struct run *run = run_of(task);

		if (run)
			unnote_rseq(run, task);
		return 0;
	}
	/* Freed with the leader's task anyway; gone now, so that a zombie
	 * reports no count and holds no quota. */
	run = run_of(task);
	if (run)
		run_uncharge(run);
	bpf_task_storage_delete(&runs, task->group_leader);
	c = current_counters(&cg);
	if (c) {
		add(&c->exits);
		/* The kernel wrote a core file for it (core_pattern without a
		 * pipe), with no syscall of the process's own. */
		if (task->exit_code & 0x80)
			count_fs(c, FS_COREDUMP);
	}
	return 0;
}

#define TRACE_SIGNAL_DELIVERED 0
#define TRACE_SIGNAL_LOSE_INFO 4

/*
 * Whether a tracer outside every watched cgroup traces `task`: CRIU while it
 * dumps the container (the container is frozen meanwhile, so nothing of it
 * acts on the task). What the task does or gets then is the dump's own work
 * (its parasite's syscalls, the SIGTRAP of each of its breakpoints). A tracer
 * inside a container is not that: a process it traces is counted like any
 * other, and its ptrace calls are counted for the whole container by
 * crab_ptrace.
 */
static __always_inline int traced_from_outside(struct task_struct *task)
{
	struct task_struct *tracer;
	__u64 cg;

	if (!BPF_CORE_READ(task, ptrace))
		return 0;
	tracer = BPF_CORE_READ(task, parent); /* the tracer while traced */
	return tracer && !task_counters(tracer, &cg);
}

/*
 * Whether `task` raises the signal at itself (a fault, a breakpoint) while
 * traced from outside (traced_from_outside): CRIU's parasite, about 14
 * SIGTRAPs per process and dump. A signal from another task (current is the
 * sender) is still counted. Not counting them matters for a process that was
 * not idle between the turn end and the dump (an idle one gets its mark
 * refreshed after the freeze): else its next turn would read CRIU's own work
 * as a signal it received.
 */
static __always_inline int dump_signal(struct task_struct *task)
{
	if (BPF_CORE_READ(task, tgid) != (__u32)(bpf_get_current_pid_tgid() >> 32))
		return 0; /* another task sends it: counted */
	return traced_from_outside(task);
}

/*
 * A signal queued to a task of a watched cgroup, by anyone but CRIU's
 * parasite (dump_signal): counted on its process. It either wakes the
 * process (which then runs: its memory is compared) or stays pending
 * (blocked, or the process is stopped), which is
 * state no memory comparison shows: the turn end compares the pending sets,
 * and this count says whether the same set may hold new signals (a second
 * real-time signal of one number). Ignored, merged (already pending) and
 * refused signals changed nothing.
 */
SEC("tp_btf/signal_generate")
int BPF_PROG(crab_signal, int sig, void *info, struct task_struct *task, int group, int result)
{
	struct counters *c;
	struct run *run;
	__u64 cg;

	if (result != TRACE_SIGNAL_DELIVERED && result != TRACE_SIGNAL_LOSE_INFO)
		return 0;
	c = task_counters(task, &cg);
	if (!c)
		return 0;
	if (dump_signal(task))
		return 0;
	run = run_of(task);
	if (!run) {
		if (task->flags & PF_EXITING)
			return 0; /* it exits: nothing stays pending */
		run = run_make(task, cg, c);
		if (!run)
			return 0; /* counted by run_make: the turn is degraded */
	}
	add(&run->signals);
	return 0;
}

#define EINTR 4
#define EAGAIN 11
#define ETIMEDOUT 110
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516

/* A wait that ended without an event: timed out, or interrupted (a signal,
 * which is counted on its own, or the freezer). */
static __always_inline int no_event(long ret)
{
	switch (-ret) {
	case 0:
	case EINTR:
	case EAGAIN:
	case ETIMEDOUT:
	case ERESTARTSYS:
	case ERESTARTNOINTR:
	case ERESTARTNOHAND:
	case ERESTART_RESTARTBLOCK:
		return 1;
	}
	return 0;
}

/*
 * Whether syscall `nr`, having returned `ret`, is one after which nobody
 * outside the process can tell that it made it, and which told the process
 * nothing from outside itself but the time: a wait that ended with no event,
 * a clock, its own memory (private anonymous only: a file mapping reads the
 * file), its own signal set-up, its own ids. Everything else (any read,
 * write, stat, open, close, fork, a wait that returned an event, an fd
 * created) is an interaction. A list of the quiet ones, so that a syscall
 * not thought of counts. x86-64 numbers; elsewhere every syscall counts.
 */
static __always_inline int quiet_syscall(struct pt_regs___crab *regs, long nr, long ret)
{
	/* No syscall ran: a tracer skipped it (CRIU sets -1 while it restores
	 * a task's registers, and the exit can come after the detach) or the
	 * process asked for a number that does not exist (ENOSYS). */
	if (nr < 0)
		return 1;
#if defined(__TARGET_ARCH_x86)
	switch (nr) {
	case 7:	  /* poll */
	case 23:  /* select */
	case 232: /* epoll_wait */
	case 270: /* pselect6 */
	case 271: /* ppoll */
	case 281: /* epoll_pwait */
	case 441: /* epoll_pwait2 */
	case 128: /* rt_sigtimedwait: a signal it takes was counted */
	case 34:  /* pause */
		return no_event(ret);
	case 61:  /* wait4 (WNOHANG, no child changed) */
	case 247: /* waitid */
		return ret == 0;
	case 35:  /* nanosleep */
	case 230: /* clock_nanosleep */
	case 228: /* clock_gettime */
	case 229: /* clock_getres */
	case 96:  /* gettimeofday */
	case 201: /* time */
	case 202: /* futex: no shared mapping (checked in user space), so only
		   * its own threads */
	case 449: /* futex_waitv */
	case 273: /* set_robust_list */
	case 274: /* get_robust_list */
	case 24:  /* sched_yield */
	case 39:  /* getpid */
	case 186: /* gettid */
	case 102: /* getuid */
	case 104: /* getgid */
	case 107: /* geteuid */
	case 108: /* getegid */
	case 13:  /* rt_sigaction */
	case 14:  /* rt_sigprocmask */
	case 15:  /* rt_sigreturn */
	case 127: /* rt_sigpending */
	case 131: /* sigaltstack */
	case 219: /* restart_syscall */
	case 12:  /* brk */
	case 10:  /* mprotect (shared writable mappings are counted apart) */
	case 11:  /* munmap */
	case 25:  /* mremap */
	case 324: /* membarrier */
	case 309: /* getcpu */
	case 318: /* getrandom */
	case 98:  /* getrusage */
	case 100: /* times */
	case 99:  /* sysinfo */
	case 334: /* rseq */
	case 158: /* arch_prctl */
	case 204: /* sched_getaffinity */
	case 233: /* epoll_ctl: its own interest list */
		return 1;
	case 9: { /* mmap: private anonymous only */
		__u64 flags = SYSCALL_ARG3(regs);

		return (flags & MAP_ANONYMOUS) && (flags & MAP_TYPE) == 0x02 /* MAP_PRIVATE */;
	}
	}
#endif
	return 0;
}

/*
 * Every syscall's return on the host, attached only while some shim keeps
 * self-contained changes ([checkpoint] self_contained_changes = "keep"):
 * counts the interactions of processes that hold a run entry (those of
 * watched cgroups, struct run). A task without one (every task outside the
 * watched containers) costs one look at its task storage, which is empty.
 *
 * A process of a watched cgroup without an entry yet is not counted: user
 * space then reads no count for it (None), which never proves "nothing
 * happened"; an entry, once made, counts every interaction from then on, and
 * one made again starts at the clock (run_make), so no count is ever seen
 * twice across entries. Syscalls made while traced from outside are not
 * counted (traced_from_outside: CRIU's parasite makes them in the process
 * while it dumps it); those of a process traced by a tracer inside a container
 * are, even in a turn after the one that attached the tracer.
 */
SEC("tp_btf/sys_exit")
int BPF_PROG(crab_quiet, struct pt_regs *regs, long ret)
{
	struct pt_regs___crab *r = (struct pt_regs___crab *)regs;
	struct task_struct *task = bpf_get_current_task_btf();
	struct run *run = run_of(task);

	if (!run || quiet_syscall(r, SYSCALL_NR(r), ret) || traced_from_outside(task))
		return 0;
	add(&run->interactions);
	return 0;
}

/*
 * Runs at every context switch on the host, before the switch: current ==
 * prev. Records which process each CPU runs next, and counts the switch-out
 * of prev if its cgroup is watched.
 */
SEC("tp_btf/sched_switch")
int BPF_PROG(crab_sched_switch, _Bool preempt, struct task_struct *prev, struct task_struct *next)
{
	__u32 zero = 0;
	__u64 *slot = bpf_map_lookup_elem(&oncpu, &zero);
	int exiting = prev->flags & PF_EXITING;
	struct run *run;
	struct counters *c;
	__u64 cg;

	if (slot)
		*slot = ONCPU_VALID | (__u32)next->tgid;
	if (!prev->tgid)
		return 0; /* idle */
	c = current_counters(&cg);
	if (!c)
		return 0;
	run = run_of(prev);
	if (!run) {
		/* The final switch-outs of an exiting process come after its
		 * entry was deleted: do not bring it back. */
		if (exiting)
			return 0;
		run = run_make(prev, cg, c);
		if (!run)
			return 0;
	}
	add(&run->switches_out);
	run->cgroup_id = cg;
	if (run->flags & RUN_COMPAT)
		add(&c->errors);
	/* An exiting thread's area is no more (see crab_exit). */
	if (!exiting)
		note_rseq(run, prev);
	return 0;
}
