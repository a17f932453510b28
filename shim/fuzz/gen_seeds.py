#!/usr/bin/env python3
"""Writes the seed corpora under seeds/<target>/: small valid inputs of each parser (the
formats of shim/src/checkpoint/*.rs and runtime-config). Rerun after a format changes."""
import hashlib
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def sha(b):
    return "sha256:" + hashlib.sha256(b).hexdigest()


# checkpoint_meta: restore.rs CheckpointMeta
layer = {"digest": sha(b"layer"), "diff_id": sha(b"diff"), "size": 1024,
         "media_type": "application/vnd.oci.image.layer.v1.tar+zstd"}
meta = {"format": 1, "source": {"namespace": "default", "container": "c1", "seq": 3,
                                "turn_id": "t3"},
        "fs_layers": [layer], "process": {"pids": [1, 7]},
        "created_at": "2026-12-01T18:00:00Z"}
meta_json = json.dumps(meta).encode()
put("checkpoint_meta", "full.json", meta_json)
put("checkpoint_meta", "fs-only.json", json.dumps(dict(meta, process=None)))

# store_manifest: store.rs Manifest
manifest = {"format": 1, "seq": 2, "parent": 1, "turn_id": "t2", "kind": "full",
            "fs_layers": [layer], "image_layers": 1,
            "process": {"image": "proc/2", "bytes_stored": 4096, "bytes_logical": 8192,
                        "pids": [1]},
            "created_at": "2026-12-01T18:00:00Z",
            "timings": {"freeze_ms": 1.5, "capture_ms": 2.0, "total_ms": 4.0},
            "explanation": "turn end"}
put("store_manifest", "full.json", json.dumps(manifest))
put("store_manifest", "fs.json", json.dumps(dict(manifest, kind="fs", process=None,
                                                 parent=None)))

# signature: provenance.rs signature.json, NUL, checkpoint.json (not validly signed: the
# target re-signs what parses)
statement = {"checkpoint_json": sha(meta_json),
             "criu": {"core-1.img": {"sha256": sha(b"core"), "size": 4},
                      "pages-1.img": {"sha256": sha(b""), "size": 0}}}
sig = {"format": 1, "key": "ed25519:" + "ea" * 32, "statement": statement,
       "signature": "00" * 64}
put("signature", "signed", json.dumps(sig).encode() + b"\0" + meta_json)

# pages: pages.rs recipe (CRABPGS1, len, chunk size, pad, digests) and index (CRABIDX1,
# pack len, count, (digest, offset, len)*)
d = hashlib.sha256(b"chunk").digest()
put("pages", "recipe", b"CRABPGS1" + struct.pack("<QII", 8192, 4096, 0) + d + d)
put("pages", "index", b"CRABIDX1" + struct.pack("<QQ", 8192, 2)
    + d + struct.pack("<QI", 0, 4096) + d + struct.pack("<QI", 4096, 4096))


# criu_image: criu_image.rs, the files in the order asked for, separated
def varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v == 0:
            return out + bytes([b])
        out += bytes([b | 0x80])


def vfield(n, v):
    return varint(n << 3) + varint(v)


def bfield(n, b):
    return varint((n << 3) | 2) + varint(len(b)) + b


COMMON, INVENTORY, PSTREE, CORE, IDS = 0x54564319, 0x58313116, 0x50273030, 0x55053847, 0x54432030


def image(magic, common, entries):
    out = struct.pack("<I", COMMON) if common else b""
    out += struct.pack("<I", magic)
    for e in entries:
        out += struct.pack("<I", len(e)) + e
    return out


def ns_ids(base):
    m = b"".join(vfield(n, n) for n in range(1, 5))
    return m + b"".join(vfield(n, base + n) for n in range(5, 13))


def creds(caps, nnp):
    m = b"".join(vfield(n, 0) for n in range(1, 9))
    for n in range(9, 13):
        m += vfield(n, caps & 0xFFFFFFFF) + vfield(n, caps >> 32)
    m += vfield(13, 0) + vfield(14, 0) + vfield(18, nnp)
    return m + vfield(19, 0) + vfield(19, 0)


def core(state, c, seccomp):
    tc = vfield(1, state) + vfield(2, 0) + bfield(6, b"sh")
    th = vfield(1, 0) + vfield(2, 0)
    if c is not None:
        th += bfield(10, c) + vfield(11, seccomp)
    return image(CORE, True, [vfield(1, 1) + bfield(3, tc) + bfield(5, th)])


def pstree(tasks):
    entries = []
    for pid, threads in tasks:
        m = vfield(1, pid) + vfield(2, 0) + vfield(3, pid) + vfield(4, pid)
        m += b"".join(vfield(5, t) for t in threads)
        entries.append(m)
    return image(PSTREE, True, entries)


SEP = b"#CRABFILE#"
inventory = image(INVENTORY, False, [vfield(1, 2) + bfield(3, ns_ids(0))])
ids = image(IDS, True, [ns_ids(100)])
root = creds(0xA80425FB, 0)
# One task: inventory, pstree, core-1, ids-1.
put("criu_image", "one-task", SEP.join([inventory, pstree([(1, [])]), core(1, root, 0), ids]))
# Two tasks, the second with two threads and a zombie: core-1, ids-1, core-7, core-8.
put("criu_image", "threads", SEP.join([
    inventory, pstree([(1, []), (7, [7, 8])]), core(1, root, 2), ids,
    core(1, creds(0, 1), 2), core(2, None, 0)]))

# runtime_options: runtimeoptions.v1.Options (type_url 1, config_path 2, config_body 3)
toml = b'[restore]\nunsigned_images = "start-fresh"\n'
put("runtime_options", "path", bfield(2, b"/etc/crab/crab.toml"))
put("runtime_options", "body", bfield(1, b"") + bfield(3, toml))

# config_toml: crab's example config
with open(os.path.join(HERE, "../../runtime-config/examples/crab.toml"), "rb") as f:
    put("config_toml", "example.toml", f.read())
put("config_toml", "small.toml", toml)

# spec_annotations: an OCI spec with crab's annotations, and an Update's annotations
spec = {"ociVersion": "1.2.0",
        "process": {"user": {"uid": 0, "gid": 0, "additionalGids": [10]},
                    "args": ["sh"], "cwd": "/", "noNewPrivileges": True,
                    "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"],
                                     "permitted": ["CAP_CHOWN"], "effective": ["CAP_CHOWN"]}},
        "root": {"path": "rootfs"},
        "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "network"}],
                  "seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}},
        "annotations": {"io.crab/checkpoint-policy": "minimal",
                        "io.crab/turn-boundary": "t1"}}
put("spec_annotations", "spec.json", json.dumps(spec))
put("spec_annotations", "update.json", json.dumps({"io.crab/turn-boundary": "turn-7"}))

# procfs: /proc/PID/stat (a hostile comm) and maps lines
put("procfs", "stat", "42 (a) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 "
    "12345 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n")
put("procfs", "maps", "55d0c0000000-55d0c0021000 r-xp 00000000 fd:01 1234   /usr/bin/sh\n"
    "7ffd1000-7ffd2000 rw-p 00000000 00:00 0                  [stack]\n"
    "7f00-8f00 rw-s 00001000 00:05 99 /x (deleted)\n")

# replica_segments: byte 0 picks 1-3 signed files, a u32 size each, then 10-byte blob records
# (file index, media parity, i32 size, u32 offset; 0xffffffff = no offset annotation).
def seg(file, size, offset, media=0):
    return bytes([file, media]) + struct.pack("<iI", size, offset)

MIN = 32 * 4096
put("replica_segments", "one-file-one-segment",
    bytes([0]) + struct.pack("<I", 1000) + seg(0, 1000, 0))
put("replica_segments", "two-files-segmented",
    bytes([1]) + struct.pack("<II", 100, MIN + 10)
    + seg(0, 100, 0) + seg(1, MIN, 0) + seg(1, 10, MIN))
put("replica_segments", "older-crab-whole-file",
    bytes([0]) + struct.pack("<I", 5 << 20) + seg(0, 5 << 20, 0xffffffff))

# lazy_pagemap: restore/eager.rs, an mm-<pid>.img, SEP, its pagemap-<pid>.img
def mm(arg, env):
    return image(0x57492820, True, [b"".join(vfield(n, v) for n, v in
                 [(1, 0x400000), (8, arg[0]), (9, arg[1]), (10, env[0]), (11, env[1])])])


def pmentry(vaddr, nr, flags):
    return vfield(1, vaddr) + vfield(2, 0) + vfield(4, flags) + vfield(5, nr)


def pagemap(entries):
    return image(0x56084025, True, [vfield(1, 1)] + [pmentry(*e) for e in entries])


put("lazy_pagemap", "stack-split", SEP.join([
    mm((0x7ffd0006010, 0x7ffd0006ff0), (0x7ffd0006ff0, 0x7ffd0007100)),
    pagemap([(0x1000000, 100, 6), (0x7ffd0000000, 8, 6)])]))
put("lazy_pagemap", "nothing-lazy", SEP.join([
    mm((0x2000, 0x2100), (0x2100, 0x2200)), pagemap([(0x1000, 4, 4), (0x8000, 2, 1)])]))
