/* SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0 */
/*
 * The few kernel structures the inspector reads, hand-written instead of a
 * generated vmlinux.h (megabytes, tied to one kernel). preserve_access_index
 * turns every field access into a CO-RE relocation that the loader (aya)
 * resolves against the running kernel's BTF (/sys/kernel/btf/vmlinux), so the
 * field order and offsets below do not matter; only names and types do.
 */
#ifndef CRAB_KERNEL_H
#define CRAB_KERNEL_H

#define __crab_core __attribute__((preserve_access_index))

struct kernfs_node {
	__u64 id; /* == inode number of the cgroup2 directory on 64-bit */
} __crab_core;

struct cgroup {
	int level; /* 0 = root of the cgroup2 hierarchy */
	struct kernfs_node *kn;
	struct cgroup *ancestors[]; /* ancestors[level] == self */
} __crab_core;

struct css_set {
	struct cgroup *dfl_cgrp; /* the task's cgroup2 cgroup */
} __crab_core;

struct super_block {
	unsigned long s_magic;
	__u32 s_dev; /* dev_t: major << 20 | minor, what stat(2) shows as st_dev */
} __crab_core;

struct inode {
	unsigned short i_mode;
	struct super_block *i_sb;
} __crab_core;

struct qstr {
	const unsigned char *name;
} __crab_core;

struct dentry {
	struct qstr d_name;
	struct super_block *d_sb;
} __crab_core;

struct path {
	struct dentry *dentry;
} __crab_core;

struct file {
	struct inode *f_inode;
	struct path f_path;
} __crab_core;

struct fdtable {
	unsigned int max_fds;
	struct file **fd;
} __crab_core;

struct files_struct {
	struct fdtable *fdt;
} __crab_core;

struct fs_struct {
	struct path root; /* chroot(2), pivot_root(2), a mount namespace entered */
	struct path pwd;
} __crab_core;

typedef struct {
	int counter;
} atomic_t;

struct signal_struct {
	atomic_t live; /* threads not yet exiting; 0 once the last one exits */
} __crab_core;

struct task_struct {
	unsigned int flags;
	int pid;  /* thread id */
	int tgid; /* process id */
	struct files_struct *files;
	struct fs_struct *fs;
	struct css_set *cgroups;
	struct signal_struct *signal;
	struct task_struct *group_leader; /* the process's first thread */
	int exit_code; /* what wait() reports; bit 0x80: a core was dumped */
	unsigned int ptrace; /* PT_* flags: non-zero while a tracer is attached */
	struct task_struct *parent; /* the tracer while traced, else real_parent */
} __crab_core;

/* Linux 4.18-6.18: the thread's registered struct rseq (a user pointer). A
 * flavor of its own so that a kernel where the field is not that pointer
 * fails only the existence check, not the load. */
struct task_struct___rseq_ptr {
	void *rseq;
} __crab_core;

struct linux_binprm {
	char buf[256]; /* first bytes of the executable finally loaded */
} __crab_core;

struct vm_area_struct {
	unsigned long vm_start;
	unsigned long vm_end;
	unsigned long vm_flags;
	struct file *vm_file;
} __crab_core;

/*
 * Saved user registers of a task in a syscall (bpf_task_pt_regs), for the
 * arguments of syscalls 1 and 2 (0-based), which survive until sys_exit on
 * both architectures (arm64 overwrites x0 with the return value). The
 * ___crab suffix is a CO-RE flavor: it matches the kernel's struct pt_regs.
 */
#if defined(__TARGET_ARCH_x86)
struct pt_regs___crab {
	unsigned long si;
	unsigned long dx;
	unsigned long r10;
	unsigned long orig_ax;
} __crab_core;
#define SYSCALL_ARG1(regs) ((regs)->si)
#define SYSCALL_ARG2(regs) ((regs)->dx)
#define SYSCALL_ARG3(regs) ((regs)->r10)
#define SYSCALL_NR(regs) ((long)(regs)->orig_ax)
#elif defined(__TARGET_ARCH_arm64)
struct pt_regs___crab {
	__u64 regs[31];
	__s32 syscallno;
} __crab_core;
#define SYSCALL_ARG1(regs) ((regs)->regs[1])
#define SYSCALL_ARG2(regs) ((regs)->regs[2])
#define SYSCALL_ARG3(regs) ((regs)->regs[3])
#define SYSCALL_NR(regs) ((long)(regs)->syscallno)
#else
#error "inspector: unsupported architecture"
#endif

#endif
