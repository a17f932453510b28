// SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0
/*
 * crab's restore check: what the kernel holds for a restored task that /proc
 * does not show. A task iterator (iter/task) that, for every thread of the
 * processes listed in `crab_restored_tgids`, writes one record to the
 * iterator's file: the thread's securebits, its seccomp filter count, and one
 * of its seccomp filter programs (the classic BPF the filter was installed
 * with, which the kernel keeps for checkpoint/restore), chosen by
 * `crab_restored_params.index` counted from the oldest filter.
 *
 * Read by the shim's restore::seccomp while CRIU holds the restored tree
 * stopped at pre-resume: CRIU is the tracer then, so PTRACE_SECCOMP_GET_FILTER
 * is not ours to call. Nothing here writes kernel state.
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "restored.h"

char LICENSE[] SEC("license") = "GPL";

/* Which processes to report (host tgids; the value is unused). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, RESTORED_TGIDS_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
} crab_restored_tgids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct restored_params);
} crab_restored_params SEC(".maps");

/* One record and its program, assembled here and written in one piece. */
struct out {
	struct restored_record r;
	__u64 insns[RESTORED_INSNS_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct out);
} crab_restored_buf SEC(".maps");

SEC("iter/task")
int crab_restored_task(struct bpf_iter__task *ctx)
{
	struct seq_file *seq = ctx->meta->seq;
	struct task_struct *task = ctx->task;
	__u32 zero = 0;

	if (!task)
		return 0;
	__u32 tgid = task->tgid;
	if (!bpf_map_lookup_elem(&crab_restored_tgids, &tgid))
		return 0;
	struct restored_params *p = bpf_map_lookup_elem(&crab_restored_params, &zero);
	struct out *o = bpf_map_lookup_elem(&crab_restored_buf, &zero);
	if (!p || !o)
		return 0;

	o->r.magic = RESTORED_MAGIC;
	o->r.tid = task->pid;
	o->r.tgid = tgid;
	o->r.securebits = BPF_CORE_READ(task, real_cred, securebits);
	o->r.exit_state = task->exit_state;
	o->r.seccomp_mode = task->seccomp.mode;
	__u32 count = BPF_CORE_READ(task, seccomp.filter_count.counter);
	o->r.filter_count = count;
	o->r.index = p->index;
	o->r.len = RESTORED_NO_FILTER;

	struct seccomp_filter *f = BPF_CORE_READ(task, seccomp.filter);
	if (p->index >= count || !f)
		goto write_header;
	/* The chain runs from the newest filter to the oldest. */
	__u32 steps = count - 1 - p->index;
	if (steps > RESTORED_WALK_MAX) {
		o->r.len = RESTORED_CHAIN_TOO_LONG;
		goto write_header;
	}
	for (__u32 i = 0; i < RESTORED_WALK_MAX; i++) {
		if (i >= steps || !f)
			break;
		f = BPF_CORE_READ(f, prev);
	}
	if (!f)
		goto write_header;
	struct sock_fprog_kern *fp = BPF_CORE_READ(f, prog, orig_prog);
	if (!fp) {
		o->r.len = RESTORED_NO_PROGRAM;
		goto write_header;
	}
	__u32 len = BPF_CORE_READ(fp, len);
	void *insns = BPF_CORE_READ(fp, filter);
	if (len == 0 || len > RESTORED_INSNS_MAX || !insns) {
		o->r.len = RESTORED_PROGRAM_TOO_LONG;
		goto write_header;
	}
	if (bpf_probe_read_kernel(o->insns, len * 8, insns)) {
		o->r.len = RESTORED_NO_PROGRAM;
		goto write_header;
	}
	o->r.len = len;
	bpf_seq_write(seq, o, sizeof(o->r) + len * 8);
	return 0;
write_header:
	bpf_seq_write(seq, &o->r, sizeof(o->r));
	return 0;
}
