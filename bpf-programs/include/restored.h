/* SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0 */
/*
 * The record layout of restored.bpf.c, shared with the shim's
 * restore::seccomp (keep the two in step), and the few kernel structures it
 * reads, declared with preserve_access_index so that aya relocates every field
 * access against the running kernel's BTF (names and types matter, not order).
 */
#ifndef CRAB_RESTORED_H
#define CRAB_RESTORED_H

#define RESTORED_MAGIC 0x63726231u /* "crb1" */
#define RESTORED_TGIDS_MAX 65536
/* The iterator's seq buffer is 8 pages: a record and its program fit. */
#define RESTORED_INSNS_MAX 4000
/* How far down a chain of filters a record may reach. */
#define RESTORED_WALK_MAX 1024

/* restored_record.len when no program follows. */
#define RESTORED_NO_FILTER (-1)       /* no filter at that index */
#define RESTORED_NO_PROGRAM (-2)      /* the filter's program is not readable */
#define RESTORED_PROGRAM_TOO_LONG (-3)
#define RESTORED_CHAIN_TOO_LONG (-4)

struct restored_params {
	__u32 index; /* which filter, counted from the oldest (0) */
	__u32 pad;
};

struct restored_record {
	__u32 magic;
	__u32 tid;
	__u32 tgid;
	__u32 securebits;
	__u32 filter_count;
	__u32 index;
	__s32 len; /* instructions that follow (8 bytes each), or RESTORED_NO_* */
	__s32 exit_state;
	__s32 seccomp_mode;
	__u32 pad;
};

#define __crab_core __attribute__((preserve_access_index))

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __crab_core;

struct sock_fprog_kern {
	__u16 len;
	void *filter; /* struct sock_filter[len], 8 bytes each */
} __crab_core;

struct bpf_prog {
	struct sock_fprog_kern *orig_prog;
} __crab_core;

struct seccomp_filter {
	struct seccomp_filter *prev;
	struct bpf_prog *prog;
} __crab_core;

typedef struct {
	int counter;
} atomic_t;

struct seccomp {
	int mode;
	atomic_t filter_count;
	struct seccomp_filter *filter;
} __crab_core;

struct cred {
	unsigned int securebits;
} __crab_core;

struct task_struct {
	int pid;
	int tgid;
	int exit_state;
	const struct cred *real_cred;
	struct seccomp seccomp;
} __crab_core;

struct bpf_iter__task {
	struct bpf_iter_meta *meta;
	struct task_struct *task;
} __crab_core;

#endif
