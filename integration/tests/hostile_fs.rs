//! A hostile agent's filesystem against crab's bounds, through containerd and the crab shim:
//! a terabyte sparse file, a tree deeper than the walk bound, a manifest over the entry bound
//! and the `user.overlay.*` xattrs overlayfs ignores on a mount without `userxattr`. Each one
//! must end in a bounded, explained outcome (a small layer, or a `failed` checkpoint naming the
//! `[limits]` key) while the container keeps running, its shim stays small and a neighbouring
//! sandbox's checkpoints keep working. And a container sharing a tracked volume that races
//! the volume's refill with symlinks: nothing may be written outside the volume.

use std::{
    collections::BTreeMap,
    io::Read,
    time::{Duration, Instant},
};

use crab_integration::{
    host,
    sandbox::{Sandbox, SandboxOptions},
    Harness, TaskStatus,
};
use serde_json::Value;

/// crabctl must succeed; returns its stdout.
fn crabctl_ok(s: &Sandbox, args: &[&str]) -> String {
    let (code, out, err) = s.crabctl(args);
    assert_eq!(
        code, 0,
        "crabctl {args:?} failed:\nstdout: {out}\nstderr: {err}"
    );
    out
}

/// Removes crabctl's internal images of a container when the test ends, however it ends.
struct InternalImages {
    h: Harness,
    of: String,
}

impl Drop for InternalImages {
    fn drop(&mut self) {
        for name in self.h.internal_images(&self.of) {
            let _ = self.h.ctr().run(&["images", "rm", &name]);
        }
    }
}

/// The layer blob of `desc` in the sandbox's store, decompressed (a plain tar).
fn plain_layer(s: &Sandbox, desc: &Value) -> Vec<u8> {
    let digest = desc["digest"]
        .as_str()
        .unwrap()
        .strip_prefix("sha256:")
        .unwrap();
    let blob = std::fs::read(s.store().join("blobs/sha256").join(digest)).unwrap();
    zstd::decode_all(&blob[..]).unwrap()
}

/// A tar entry's type byte and pax xattrs.
type EntryXattrs = (u8, Vec<(String, Vec<u8>)>);

/// Tar entries with their pax xattrs: name -> (entry type byte, xattrs).
fn entries_with_xattrs(tar: &[u8]) -> BTreeMap<String, EntryXattrs> {
    let mut out = BTreeMap::new();
    for e in tar::Archive::new(tar).entries().unwrap() {
        let mut e = e.unwrap();
        let name = String::from_utf8_lossy(&e.path_bytes()).into_owned();
        let kind = e.header().entry_type().as_byte();
        let mut xattrs = Vec::new();
        if let Some(pax) = e.pax_extensions().unwrap() {
            for ext in pax {
                let ext = ext.unwrap();
                if let Some(name) = ext.key().unwrap().strip_prefix("SCHILY.xattr.") {
                    xattrs.push((name.to_string(), ext.value_bytes().to_vec()));
                }
            }
        }
        let mut sink = Vec::new();
        e.read_to_end(&mut sink).unwrap();
        out.insert(name, (kind, xattrs));
    }
    out
}

/// The shim serving `s`: its pid and (VmRSS, VmHWM) in KiB.
fn shim_memory(s: &Sandbox) -> (i32, u64, u64) {
    let shims = host::shim_processes(&s.id);
    assert_eq!(shims.len(), 1, "one shim for {}: {shims:?}", s.id);
    let pid = shims[0].pid;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
    };
    (pid, kib("VmRSS:"), kib("VmHWM:"))
}

async fn assert_running(s: &Sandbox) {
    let (status, _) = s.h.status(&s.id, "").await.unwrap();
    assert_eq!(status, TaskStatus::Running, "{} is not running", s.id);
}

/// A neighbour's fs turn, checkpointed as usual (the `n`th manifest of its store).
async fn neighbour_turn(b: &mut Sandbox, n: usize) {
    b.run(&format!("echo {n} > /app/n{n}")).await;
    b.end_turn().await;
    let m = b.wait_manifests(n).await;
    assert_eq!(
        m[n - 1]["kind"],
        "fs",
        "the neighbour's checkpoint: {:#}",
        m[n - 1]
    );
}

/// Sparse files are stored with their holes, and bounded by their apparent size (what
/// containerd's differ writes when it unpacks a layer: it writes holes as zeros).
/// A 256 MiB sparse file: a layer of a few KB, from which an in-place rollback (crab's own
/// reader) brings it back with its holes. `truncate -s 1T` and a few bytes: over `[limits]
/// max_layer_apparent_bytes` (64 GiB by default), the turn's checkpoint is recorded `failed` at
/// once naming the key, the container keeps running and a neighbour's checkpoints carry on. A
/// 48 GiB sparse file, under the bound: the next checkpoint (full, after the failure) holds it
/// in a layer of a few KB, from which GNU tar extracts it with its holes. Last, the 256 MiB
/// file through a recreating rollback (containerd's differ): the same size and bytes.
#[tokio::test(flavor = "multi_thread")]
async fn sparse_files_checkpoint_small_and_restore() {
    let (mut s, _g) = Sandbox::start("hostile_sparse", SandboxOptions::default()).await;
    let (mut b, _gb) = Sandbox::start("hostile_sparse_nb", SandboxOptions::default()).await;
    let _images = InternalImages {
        h: s.h.clone(),
        of: s.id.clone(),
    };
    neighbour_turn(&mut b, 1).await;

    // Turn 1: 256 MiB apparent, three data regions (one at the very end), sha256 recorded.
    let sum = s
        .run(
            "truncate -s 256M s && printf head | dd of=s conv=notrunc status=none && \
             printf middle | dd of=s bs=1 seek=$((100 << 20)) conv=notrunc status=none && \
             printf end | dd of=s bs=1 seek=$(((256 << 20) - 3)) conv=notrunc status=none && \
             sha256sum s | cut -d' ' -f1",
        )
        .await
        .stdout;
    s.end_turn().await;
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "fs", "{:#}", m[0]);
    let small = &m[0]["fs_layers"][0];
    assert!(
        small["size"].as_u64().unwrap() < 64 << 10,
        "256 MiB sparse stored as {:#}",
        small
    );
    // Back to turn 1 in place, after the file is gone: the same size and bytes, and its holes
    // (a few blocks, not 256 MiB).
    let check = "stat -c %s s; sha256sum s | cut -d' ' -f1; stat -c %b s";
    let want = format!("268435456\n{sum}");
    s.run("rm s").await;
    s.end_turn().await;
    s.wait_manifests(2).await;
    let r = crabctl_ok(&s, &["rollback", &s.id, "--to", "t1", "-o", "json"]);
    let r: Value = serde_json::from_str(r.trim()).unwrap();
    assert_eq!(r["way"], "in_place", "{r:#}");
    s.turn = 100;
    let after = s.run(check).await.stdout;
    assert!(
        after.starts_with(&want),
        "after the in-place rollback: {after}"
    );
    let blocks: u64 = after.lines().last().unwrap().parse().unwrap();
    eprintln!("in-place rollback: the 256 MiB sparse file in {blocks} blocks");
    assert!(
        blocks * 512 < 1 << 20,
        "holes written as data: {blocks} blocks"
    );

    // A sparse terabyte, over the default apparent-size bound.
    s.run("truncate -s 1T huge && printf tail | dd of=huge bs=1 seek=$(((1 << 40) - 4)) conv=notrunc status=none")
        .await;
    let t = Instant::now();
    s.end_turn().await;
    let m = s.wait_manifests(3).await;
    let took = t.elapsed();
    assert_eq!(m[2]["kind"], "failed", "{:#}", m[2]);
    let why = m[2]["explanation"].as_str().unwrap();
    eprintln!("1 TB sparse turn: recorded in {took:?}: {why}");
    assert!(
        why.contains("[limits] max_layer_apparent_bytes")
            && why.contains("68719476736")
            && why.contains("app/huge"),
        "{why}"
    );
    assert!(
        took < Duration::from_secs(15),
        "the checkpoint of a sparse terabyte took {took:?}"
    );
    assert_running(&s).await;
    neighbour_turn(&mut b, 2).await;

    // 48 GiB sparse, under the bound: a full checkpoint (after the failure) of a few KB.
    s.run("rm huge && truncate -s 48G mid && printf tail | dd of=mid bs=1 seek=$(((48 << 30) - 4)) conv=notrunc status=none")
        .await;
    let t = Instant::now();
    s.end_turn().await;
    let m = s.wait_manifests(4).await;
    let took = t.elapsed();
    assert_eq!(m[3]["kind"], "full", "{:#}", m[3]);
    let mid = m[3]["fs_layers"].as_array().unwrap().last().unwrap();
    let stored = mid["size"].as_u64().unwrap();
    eprintln!("48 GiB sparse turn: checkpoint durable in {took:?}, layer of {stored} bytes");
    assert!(
        stored < 64 << 10,
        "a sparse 48 GiB stored as {stored} bytes"
    );
    // The layer holds a sparse 48 GiB: GNU tar extracts it with its holes.
    let tar = plain_layer(&s, mid);
    assert!(tar.len() < 1 << 20, "{} bytes of tar", tar.len());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.tar"), &tar).unwrap();
    let out = std::process::Command::new("tar")
        .arg("-xf")
        .arg(dir.path().join("l.tar"))
        .arg("-C")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let extracted = dir.path().join("app/mid");
    let md = std::fs::metadata(&extracted).unwrap();
    assert_eq!(md.len(), 48 << 30);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&md) < 2048,
        "extracted with its holes"
    );
    let mut tail = [0u8; 4];
    std::os::unix::fs::FileExt::read_exact_at(
        &std::fs::File::open(&extracted).unwrap(),
        &mut tail,
        (48 << 30) - 4,
    )
    .unwrap();
    assert_eq!(&tail, b"tail");
    drop(dir);
    neighbour_turn(&mut b, 3).await;

    // Back to turn 1 through containerd's differ (the container recreated): the same size and
    // bytes, no 48 GiB file.
    s.run("rm mid").await;
    s.end_turn().await;
    s.wait_manifests(5).await;
    crabctl_ok(&s, &["rollback", &s.id, "--to", "t1", "--recreate"]);
    s.turn = 200;
    let after = s
        .run(&format!("{check}; test ! -e mid && echo no-mid"))
        .await
        .stdout;
    assert!(
        after.starts_with(&want) && after.ends_with("no-mid\n"),
        "after the recreating rollback to t1: {after}"
    );
    eprintln!(
        "recreating rollback: the 256 MiB sparse file in {} blocks (containerd's differ writes holes as zeros)",
        after.lines().nth(2).unwrap_or("?")
    );
    s.finish().await;
    b.finish().await;
}

/// A tree ~900 levels deep of 200-byte names (its manifest would hold ~80 MB of paths, its
/// walk ~900 fds and frames): the walk stops at `max_walk_depth`, the turn's checkpoint is
/// recorded `failed` naming the key, the container keeps running, the shim's memory stays
/// small, and a neighbour's checkpoints carry on meanwhile. Removing the tree makes the next
/// checkpoint succeed again (a full one, after the failure).
#[tokio::test(flavor = "multi_thread")]
async fn deep_tree_fails_the_turn_not_the_shim() {
    let (mut a, _ga) = Sandbox::start("hostile_deep", SandboxOptions::default()).await;
    let (mut b, _gb) = Sandbox::start("hostile_deep_nb", SandboxOptions::default()).await;
    neighbour_turn(&mut b, 1).await;
    let (pid, rss_before, _) = shim_memory(&a);

    // Relative mkdir/chdir: the path outgrows PATH_MAX after 20 levels.
    a.run(&format!(
        "python3 -c \"import os\nos.mkdir('deep'); os.chdir('deep')\nfor i in range(900):\n    os.mkdir('{n}'); os.chdir('{n}')\nopen('leaf', 'w').write('leaf')\"",
        n = "d".repeat(200)
    ))
    .await;
    let answer = a.end_turn().await;
    assert_eq!(answer["kind"], "full", "{answer:#}");
    let degraded = answer["degraded"].to_string();
    assert!(degraded.contains("max_walk_depth"), "{answer:#}");
    // Meanwhile, the neighbour.
    neighbour_turn(&mut b, 2).await;
    let m = a.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "failed", "{:#}", m[0]);
    let why = m[0]["explanation"].as_str().unwrap();
    assert!(
        why.contains("[limits] max_walk_depth") && why.contains("256"),
        "{why}"
    );
    assert_running(&a).await;
    let (pid_after, rss, hwm) = shim_memory(&a);
    eprintln!(
        "shim of the deep tree: VmRSS {rss_before} KiB before, {rss} KiB after, peak {hwm} KiB"
    );
    assert_eq!(pid_after, pid, "the shim was replaced");
    assert!(hwm < 64 << 10, "the shim peaked at {hwm} KiB");

    // The container works on; without the tree the next checkpoint is whole again.
    a.run("rm -rf deep && echo fine > after").await;
    a.end_turn().await;
    let m = a.wait_manifests(2).await;
    assert_eq!(m[1]["kind"], "full", "{:#}", m[1]);
    let l = a.layer(m[1]["fs_layers"].as_array().unwrap().last().unwrap());
    assert_eq!(
        l.get("app/after").map(|(_, d)| d.as_slice()),
        Some(&b"fine\n"[..])
    );
    neighbour_turn(&mut b, 3).await;
    a.finish().await;
    b.finish().await;
}

/// More entries than `max_manifest_entries`: the turn is recorded `failed` naming the key; the
/// container keeps running and the shim stays small; below the bound again, checkpoints resume.
#[tokio::test(flavor = "multi_thread")]
async fn manifest_over_the_entry_bound_fails_the_turn() {
    let opts = SandboxOptions {
        config: "limits.max_manifest_entries = 5000",
        ..Default::default()
    };
    let (mut s, _g) = Sandbox::start("hostile_wide", opts).await;
    s.run("echo ok > small").await;
    s.end_turn().await;
    assert_eq!(s.wait_manifests(1).await[0]["kind"], "fs");

    s.run("mkdir wide && cd wide && seq 6000 | xargs touch")
        .await;
    let answer = s.end_turn().await;
    assert!(
        answer["degraded"]
            .to_string()
            .contains("max_manifest_entries"),
        "{answer:#}"
    );
    let m = s.wait_manifests(2).await;
    assert_eq!(m[1]["kind"], "failed", "{:#}", m[1]);
    assert!(
        m[1]["explanation"]
            .as_str()
            .unwrap()
            .contains("more than 5000 entries"),
        "{:#}",
        m[1]
    );
    assert_running(&s).await;
    let (_, _, hwm) = shim_memory(&s);
    assert!(hwm < 64 << 10, "the shim peaked at {hwm} KiB");

    s.run("rm -rf wide").await;
    s.end_turn().await;
    assert_eq!(s.wait_manifests(3).await[2]["kind"], "full");
    s.finish().await;
}

/// On crab's overlay mounts (no `userxattr`) `user.overlay.*` is the container's own xattr,
/// which overlayfs ignores. Set on `/` and `/etc` (`opaque`), on a truncated image file
/// (`whiteout`) and on a directory (`redirect`, which crab cannot capture if it believed it):
/// the turn's checkpoint succeeds, hides nothing and deletes nothing, keeps the xattrs as
/// plain ones, and a rollback to it shows the whole image.
#[tokio::test(flavor = "multi_thread")]
async fn user_overlay_xattrs_are_not_overlay_state() {
    let (mut s, _g) = Sandbox::start("hostile_xattr", SandboxOptions::default()).await;
    let _images = InternalImages {
        h: s.h.clone(),
        of: s.id.clone(),
    };
    s.run(
        "mkdir -p d && : > /etc/issue && python3 -c \"import os
os.setxattr('/', 'user.overlay.opaque', b'y')
os.setxattr('/etc', 'user.overlay.opaque', b'y')
os.setxattr('/etc/issue', 'user.overlay.whiteout', b'')
os.setxattr('/app/d', 'user.overlay.redirect', b'/nowhere')\"",
    )
    .await;
    s.end_turn().await;
    // The live container still sees the image.
    assert!(s.run("cat /etc/os-release").await.stdout.contains("ID="));
    let m = s.wait_manifests(1).await;
    assert_eq!(m[0]["kind"], "fs", "{:#}", m[0]);
    let entries = entries_with_xattrs(&plain_layer(&s, &m[0]["fs_layers"][0]));
    let names: Vec<&String> = entries.keys().collect();
    assert!(
        !names.iter().any(|n| n.contains(".wh.")),
        "whiteouts in the layer: {names:?}"
    );
    let (kind, xattrs) = &entries["etc/issue"];
    assert_eq!(*kind, b'0', "etc/issue is a regular file");
    assert!(
        xattrs.iter().any(|(n, _)| n == "user.overlay.whiteout"),
        "{xattrs:?}"
    );
    let (_, etc) = &entries["etc/"];
    assert!(
        etc.contains(&("user.overlay.opaque".into(), b"y".to_vec())),
        "{etc:?}"
    );
    assert!(entries.contains_key("app/d/"), "{names:?}");

    crabctl_ok(&s, &["rollback", &s.id, "--to", "t1"]);
    s.turn = 100;
    let out = s
        .run("grep -c ID= /etc/os-release; stat -c %s /etc/issue; test -d /app/d && ls /usr/bin | grep -c python3")
        .await
        .stdout;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_ne!(lines[0], "0", "/etc/os-release lost: {out}");
    assert_eq!(lines[1], "0", "/etc/issue is an empty file: {out}");
    assert_ne!(lines[2], "0", "the image's /usr is hidden: {out}");
    s.finish().await;
}

/// The co-tenant of [`a_co_tenant_racing_a_volume_refill_gets_nothing_written_outside`]: watches
/// `/workspace` with inotify and swaps every new directory `d*` for a symlink to `OUTSIDE` (a
/// host path: the shim, on the host, is the one that would follow it) with
/// `renameat2(RENAME_EXCHANGE)`, logging the names it swapped to `/log/swapped`.
const CO_TENANT: &str = r#"
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
assert fd >= 0 and libc.inotify_add_watch(fd, b"/workspace", 0x100) >= 0  # IN_CREATE
log = open("/log/swapped", "a", buffering=1)
open("/log/ready", "w").close()
n = 0
while True:
    buf = os.read(fd, 1 << 16)
    i = 0
    while i < len(buf):
        wd, mask, cookie, size = struct.unpack_from("iIII", buf, i)
        name = buf[i + 16:i + 16 + size].rstrip(b"\0")
        i += 16 + size
        if not mask & 0x40000000 or not name.startswith(b"d"):  # IN_ISDIR
            continue
        link = b"/workspace/.link%d" % n
        n += 1
        os.symlink(b"OUTSIDE", link)
        if libc.renameat2(-100, link, -100, b"/workspace/" + name, 2) == 0:  # RENAME_EXCHANGE
            log.write(name.decode() + "\n")
"#;

/// Issue 24: a container that shares a sandbox's tracked volume races the refill of the
/// volume's host directory. While `crabctl rollback --recreate` brings back a checkpoint whose
/// volume holds 1500 directories, the co-tenant swaps each new directory for a symlink to a
/// host directory outside every volume. Nothing may be created there: the rollback fails
/// naming a swapped entry, or completes with the whole tree inside the volume.
#[tokio::test(flavor = "multi_thread")]
async fn a_co_tenant_racing_a_volume_refill_gets_nothing_written_outside() {
    const DIRS: usize = 1500;
    let home = crab_integration::TestEnv::from_env().crab_home;
    let pid = std::process::id();
    let [dir, outside, log] = ["volume", "outside", "log"].map(|n| {
        let d = home.join(format!("vrace-{n}-{pid}"));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    });
    let mut dirs = RemoveDirs(vec![dir.clone(), outside.clone(), log.clone()]);
    // Laid out as the checkpoint's directories are: a write through a swapped parent at any
    // depth would land.
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    let (mut a, _ga) = Sandbox::start(
        "vrace",
        SandboxOptions {
            volume: Some((&dir, "/workspace")),
            ..Default::default()
        },
    )
    .await;
    let _images = InternalImages {
        h: a.h.clone(),
        of: a.id.clone(),
    };
    dirs.0.push(a.state_dir.clone());
    a.run(&format!(
        "python3 -c \"import os\nfor i in range({DIRS}):\n    d = '/workspace/d%04d' % i\n    \
         os.makedirs(d + '/sub')\n    for f in range(4): open('%s/f%d' % (d, f), 'w').write('x')\n    \
         open(d + '/sub/g', 'w').write('y')\""
    ))
    .await;
    a.end_turn().await;
    let m = a.wait_manifests(1).await.pop().unwrap();
    assert_eq!(m["kind"], "fs", "{m:#}");
    assert_eq!(m["volumes"], serde_json::json!(["/workspace"]), "{m:#}");

    // The co-tenant: another crab container (checkpoints off) with the same host directory.
    let script = CO_TENANT.replace("OUTSIDE", outside.to_str().unwrap());
    let (volume, logdir) = (dir.clone(), log.clone());
    let edit = move |spec: &mut Value| {
        spec["process"]["args"] = serde_json::json!(["python3", "-c", script]);
        let mounts = spec["mounts"].as_array_mut().unwrap();
        for (source, at) in [(&volume, "/workspace"), (&logdir, "/log")] {
            mounts.push(serde_json::json!({
                "destination": at, "type": "bind", "source": source, "options": ["rbind", "rw"]
            }));
        }
    };
    let (b, _gb) = Sandbox::start(
        "vrace_cotenant",
        SandboxOptions {
            config: "checkpoint.enabled = false",
            spec_edit: Some(&edit),
            ..Default::default()
        },
    )
    .await;
    dirs.0.push(b.state_dir.clone());
    let ready = Instant::now();
    while !log.join("ready").exists() {
        assert!(
            ready.elapsed() < Duration::from_secs(30),
            "the co-tenant did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (code, out, err) = a.crabctl(&["rollback", &a.id, "--to", "t1", "--recreate"]);
    // The co-tenant stops before anything is looked at.
    b.finish().await;
    let swapped: Vec<String> = std::fs::read_to_string(log.join("swapped"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let mut leaked = Vec::new();
    let mut stack = vec![outside.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                stack.push(p.clone());
            }
            if p != outside.join("sub") {
                leaked.push(p);
            }
        }
    }
    assert!(
        leaked.is_empty(),
        "{} entries created outside the volume after {} swaps, e.g. {:?}",
        leaked.len(),
        swapped.len(),
        &leaked[..leaked.len().min(5)]
    );
    assert!(
        !swapped.is_empty(),
        "the co-tenant never raced the refill (rollback: {code} {out} {err})"
    );
    if code == 0 {
        // Everything came back, inside the volume (partly below names the co-tenant gave, a
        // directory swapped after its refill finished stays where the co-tenant put it and its
        // old name is the co-tenant's symlink).
        let files = host::tree_listing(&dir)
            .iter()
            .filter(|l| !l.ends_with('/') && !l.contains(" -> "))
            .count();
        assert_eq!(files, 5 * DIRS, "rolled back after {} swaps", swapped.len());
        eprintln!("rolled back after {} swaps", swapped.len());
        a.finish().await;
    } else {
        assert!(
            swapped
                .iter()
                .any(|n| err.contains(&format!("/workspace/{n} was replaced"))),
            "the rollback failed, but not naming a swapped entry: {err}"
        );
        eprintln!("the rollback failed after {} swaps: {err}", swapped.len());
    }
}

/// Removes host directories when the test ends, however it ends.
struct RemoveDirs(Vec<std::path::PathBuf>);

impl Drop for RemoveDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
