//! Differential test of crab's CRIU image reader against CRIU's own decoder (`crit`'s
//! `pycriu`, Debian's python3-pycriu): a real dump of a process, its core image mutated the
//! ways a hostile image would be (a second `creds` or `thread_core`, a duplicated scalar, an
//! unknown field, an overlong varint, packed capability words, flipped, cut or grown bytes),
//! each read by both. Whenever crab accepts an image, what it read of each credential must be
//! what CRIU's decoder reads (protobuf's merge rules included); crab may refuse more.
//!
//! Root: CRIU dumps a process of this test's. `CRAB_CRIT_DIFF_RUNS` sets the number of
//! mutated images (default 2000, ~3 s).

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use crab_shim::checkpoint::criu_image::{self, CriuImageError};
use serde_json::Value;

/// Reads each path given on stdin with pycriu and prints what a restore would take from it.
const DECODER: &str = r#"
import ast, json, sys
import pycriu

def text(comm):
    # A comm that is not UTF-8 comes back as bytes, or as their repr (b'...'): decoded with
    # replacement characters, as crab reads it (String::from_utf8_lossy).
    if isinstance(comm, str) and len(comm) >= 3 and comm[:2] in ("b'", 'b"') and comm[-1] == comm[1]:
        try:
            comm = ast.literal_eval(comm)
        except (ValueError, SyntaxError):
            return comm
    if isinstance(comm, bytes):
        return comm.decode("utf-8", "replace")
    return comm

for line in sys.stdin:
    path = line.rstrip("\n")
    try:
        with open(path, "rb") as f:
            img = pycriu.images.load(f)
        e = img["entries"]
        if len(e) != 1:
            raise ValueError("%d entries" % len(e))
        e = e[0]
        th = e.get("thread_core", {})
        out = {"ok": True, "creds": th.get("creds"), "seccomp_mode": th.get("seccomp_mode", 0),
               "comm": text(e.get("tc", {}).get("comm")), "task_state": e.get("tc", {}).get("task_state")}
    except Exception as ex:
        out = {"ok": False, "error": "%s: %s" % (type(ex).__name__, ex)}
    print(json.dumps(out), flush=True)
"#;

/// Reproducible mutations from a seed.
#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// `v` as a 10-byte varint (valid protobuf, longer than needed).
fn overlong(out: &mut Vec<u8>, v: u64) {
    for i in 0..9 {
        out.push(((v >> (7 * i)) as u8 & 0x7f) | 0x80);
    }
    out.push((v >> 63) as u8);
}

fn read_varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// A field: (number, wire type, the field's whole encoding, its payload).
type Field = (u32, u8, Vec<u8>, Vec<u8>);

/// A message's fields.
fn fields(msg: &[u8]) -> Option<Vec<Field>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < msg.len() {
        let start = at;
        let key = read_varint(msg, &mut at)?;
        let (number, wire) = ((key >> 3) as u32, (key & 7) as u8);
        let payload = match wire {
            0 => {
                let s = at;
                read_varint(msg, &mut at)?;
                msg[s..at].to_vec()
            }
            2 => {
                let n = read_varint(msg, &mut at)? as usize;
                let p = msg.get(at..at.checked_add(n)?)?.to_vec();
                at += n;
                p
            }
            1 => {
                at += 8;
                msg.get(at - 8..at)?.to_vec()
            }
            5 => {
                at += 4;
                msg.get(at - 4..at)?.to_vec()
            }
            _ => return None,
        };
        out.push((number, wire, msg.get(start..at)?.to_vec(), payload));
    }
    Some(out)
}

fn bytes_field(out: &mut Vec<u8>, number: u32, b: &[u8]) {
    varint(out, (u64::from(number) << 3) | 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn varint_field(out: &mut Vec<u8>, number: u32, v: u64) {
    varint(out, u64::from(number) << 3);
    varint(out, v);
}

/// A hostile `creds` message: the given one with some fields set to root's or to every
/// capability, some left out.
fn hostile_creds(rng: &mut Rng, creds: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    for (number, _, whole, _) in fields(creds).unwrap_or_default() {
        if rng.below(4) == 0 {
            continue;
        }
        match number {
            1..=8 if rng.below(2) == 0 => varint_field(&mut m, number, rng.below(3) as u64),
            9..=12 | 19 if rng.below(2) == 0 => varint_field(&mut m, number, 0xffff_ffff),
            _ => m.extend_from_slice(&whole),
        }
    }
    m
}

/// Replaces field `number` of `msg` (its first) by `edit` of its payload.
fn edit_sub(msg: &[u8], number: u32, edit: impl FnOnce(&[u8]) -> Vec<u8>) -> Vec<u8> {
    let Some(fs) = fields(msg) else {
        return msg.to_vec();
    };
    let mut out = Vec::new();
    let mut edit = Some(edit);
    for (n, wire, whole, payload) in fs {
        match (n == number && wire == 2, edit.take()) {
            (true, Some(e)) => bytes_field(&mut out, n, &e(&payload)),
            (_, e) => {
                edit = e;
                out.extend_from_slice(&whole);
            }
        }
    }
    out
}

/// One mutation of a CoreEntry message.
fn mutate(rng: &mut Rng, core: &[u8]) -> (Vec<u8>, &'static str) {
    const THREAD_CORE: u32 = 5;
    const TC: u32 = 3;
    const CREDS: u32 = 10;
    let thread_core = fields(core)
        .and_then(|f| f.into_iter().find(|f| f.0 == THREAD_CORE).map(|f| f.3))
        .unwrap_or_default();
    let creds = fields(&thread_core)
        .and_then(|f| f.into_iter().find(|f| f.0 == CREDS).map(|f| f.3))
        .unwrap_or_default();
    match rng.below(11) {
        0 => {
            // A second creds after (or before) the first.
            let extra = hostile_creds(rng, &creds);
            let before = rng.below(2) == 0;
            (
                edit_sub(core, THREAD_CORE, |tc| {
                    let mut dup = Vec::new();
                    bytes_field(&mut dup, CREDS, &extra);
                    match before {
                        true => [dup, tc.to_vec()].concat(),
                        false => [tc.to_vec(), dup].concat(),
                    }
                }),
                "second creds",
            )
        }
        1 => {
            // A second thread_core with other credentials.
            let mut tc2 = Vec::new();
            bytes_field(&mut tc2, CREDS, &hostile_creds(rng, &creds));
            if rng.below(2) == 0 {
                varint_field(&mut tc2, 11, rng.below(3) as u64);
            }
            let mut out = core.to_vec();
            bytes_field(&mut out, THREAD_CORE, &tc2);
            (out, "second thread_core")
        }
        2 => {
            // A scalar of creds repeated (uid, a cap word, no_new_privs, secbits).
            let number = [1, 3, 5, 7, 2, 9, 11, 18, 13][rng.below(9)];
            let v = [0u64, 1, 0xffff_ffff, 1000][rng.below(4)];
            (
                edit_sub(core, THREAD_CORE, |tc| {
                    edit_sub(tc, CREDS, |c| {
                        let mut c = c.to_vec();
                        varint_field(&mut c, number, v);
                        c
                    })
                }),
                "scalar repeated",
            )
        }
        3 => {
            // An unknown field, at one of three depths.
            let mut unknown = Vec::new();
            varint_field(&mut unknown, 100 + rng.below(50) as u32, 1);
            let out = match rng.below(3) {
                0 => [core.to_vec(), unknown].concat(),
                1 => edit_sub(core, THREAD_CORE, |tc| [tc.to_vec(), unknown].concat()),
                _ => edit_sub(core, THREAD_CORE, |tc| {
                    edit_sub(tc, CREDS, |c| [c.to_vec(), unknown].concat())
                }),
            };
            (out, "unknown field")
        }
        4 => {
            // Every varint of creds overlong.
            (
                edit_sub(core, THREAD_CORE, |tc| {
                    edit_sub(tc, CREDS, |c| {
                        let mut m = Vec::new();
                        for (n, wire, whole, payload) in fields(c).unwrap_or_default() {
                            if wire == 0 {
                                varint(&mut m, u64::from(n) << 3);
                                let mut at = 0;
                                overlong(&mut m, read_varint(&payload, &mut at).unwrap_or(0));
                            } else {
                                m.extend_from_slice(&whole);
                            }
                        }
                        m
                    })
                }),
                "overlong varints",
            )
        }
        5 => {
            // Capability words packed (wire type 2), as another encoder may write them.
            (
                edit_sub(core, THREAD_CORE, |tc| {
                    edit_sub(tc, CREDS, |c| {
                        let mut words: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
                        let mut m = Vec::new();
                        for (n, wire, whole, payload) in fields(c).unwrap_or_default() {
                            match (n, wire) {
                                (9..=12 | 19, 0) => words.entry(n).or_default().extend(payload),
                                _ => m.extend_from_slice(&whole),
                            }
                        }
                        for (n, packed) in words {
                            bytes_field(&mut m, n, &packed);
                        }
                        m
                    })
                }),
                "packed capability words",
            )
        }
        6 => {
            // The seccomp mode repeated, or removed.
            (
                edit_sub(core, THREAD_CORE, |tc| {
                    let mut tc = tc.to_vec();
                    varint_field(&mut tc, 11, rng.below(3) as u64);
                    tc
                }),
                "seccomp mode repeated",
            )
        }
        7 => {
            // The task's comm as bytes that are not UTF-8, or a second task_core.
            let mut out = core.to_vec();
            let mut tc = Vec::new();
            if rng.below(2) == 0 {
                bytes_field(&mut tc, 6, b"\xff\xfeevil");
            } else {
                varint_field(&mut tc, 1, 2);
            }
            bytes_field(&mut out, TC, &tc);
            (out, "second task_core")
        }
        8 => {
            // A second mutation may follow a cut to nothing: flip bits of one byte at least.
            let mut out = core.to_vec();
            if out.is_empty() {
                out.push(0);
            }
            for _ in 0..=rng.below(3) {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            (out, "bits flipped")
        }
        9 => {
            let mut out = core.to_vec();
            out.truncate(rng.below(out.len()));
            (out, "cut short")
        }
        _ => {
            let mut out = core.to_vec();
            for _ in 0..=rng.below(16) {
                out.push(rng.next() as u8);
            }
            (out, "grown")
        }
    }
}

fn cap_set(words: &Value) -> u64 {
    words
        .as_array()
        .map(|w| {
            w.iter()
                .enumerate()
                .map(|(i, v)| v.as_u64().unwrap_or(0) << (32 * i.min(1)))
                .fold(0, |a, b| a | b)
        })
        .unwrap_or(0)
}

/// The mutator itself must be total: the comparison's seed depends on the dumped pid, and one
/// CI run drew a cut to nothing followed by a bit flip (an index into an empty message).
#[test]
fn mutations_apply_to_any_message_even_an_empty_one() {
    for seed in 1..4000u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut m = match seed % 3 {
            0 => Vec::new(),
            1 => vec![0x2a, 0x02, 0x52, 0x00],
            _ => (0..seed % 64).map(|_| rng.next() as u8).collect(),
        };
        for _ in 0..4 {
            m = mutate(&mut rng, &m).0;
        }
    }
}

#[test]
fn crab_reads_credentials_as_criu_s_decoder_does() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test dumps a process with CRIU: run it as root"
    );
    assert!(
        Path::new("/usr/bin/crit").exists(),
        "CRIU's decoder is missing: hack/install-deps.sh installs python3-pycriu"
    );
    let runs: usize = std::env::var("CRAB_CRIT_DIFF_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("image");
    std::fs::create_dir(&image).unwrap();
    // A real dump: a sleeping process of this test's, in its own session.
    let mut child = Command::new("setsid")
        .args(["sleep", "1000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    std::thread::sleep(Duration::from_millis(200));
    let dump = Command::new("timeout")
        .args([
            "60",
            "criu",
            "dump",
            "-t",
            &pid.to_string(),
            "--shell-job",
            "-D",
        ])
        .arg(&image)
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        image.join("pstree.img").exists(),
        "criu dump: {}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let core_name = format!("core-{pid}.img");
    let original = std::fs::read(image.join(&core_name)).unwrap();
    // The core file: two magics, then one entry (its size, then the CoreEntry).
    let (head, rest) = original.split_at(8);
    let size = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
    let entry = &rest[4..4 + size];
    assert_eq!(rest.len(), 4 + size, "one entry in {core_name}");

    let mut decoder = Command::new("/usr/bin/python3")
        .args(["-u", "-c", DECODER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        // protobuf's C++ parser logs each comm that is not UTF-8; the verdict is on stdout.
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut to = decoder.stdin.take().unwrap();
    let mut from = BufReader::new(decoder.stdout.take().unwrap());
    let mut ask = |path: &Path| -> Value {
        writeln!(to, "{}", path.display()).unwrap();
        let mut line = String::new();
        from.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("decoder said {line:?}: {e}"))
    };
    let files: BTreeMap<String, Vec<u8>> = std::fs::read_dir(&image)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    let crab_reads = |core: &[u8]| {
        criu_image::facts_from(Path::new("/image"), &mut |path: &Path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            match name == core_name {
                true => Ok(core.to_vec()),
                false => files.get(&name).cloned().ok_or(CriuImageError::Malformed {
                    path: path.to_path_buf(),
                    reason: "missing".into(),
                }),
            }
        })
    };

    // The dump as it is: both read it, and alike.
    let mut rng = Rng(0x00c0_ffee_d00d_f00d ^ u64::from(pid));
    let (mut compared, mut refused, mut crit_only_refused) = (0usize, 0usize, Vec::new());
    let mut kinds: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let mutated_path = dir.path().join(&core_name);
    for run in 0..=runs {
        let (message, kind) = match run {
            0 => (entry.to_vec(), "as dumped"),
            _ => {
                let (mut m, mut kind) = mutate(&mut rng, entry);
                if rng.below(3) == 0 {
                    // A second mutation may undo the first (a cut that drops a second
                    // thread_core): the pair is its own kind.
                    m = mutate(&mut rng, &m).0;
                    kind = "two mutations";
                }
                (m, kind)
            }
        };
        let mut file = head.to_vec();
        file.extend_from_slice(&(message.len() as u32).to_le_bytes());
        file.extend_from_slice(&message);
        std::fs::write(&mutated_path, &file).unwrap();
        let theirs = ask(&mutated_path);
        let ours = crab_reads(&file);
        let k = kinds.entry(kind).or_default();
        let facts = match ours {
            Err(_) => {
                refused += 1;
                k.1 += 1;
                assert_ne!(run, 0, "crab refuses CRIU's own dump");
                continue;
            }
            Ok(f) => f,
        };
        k.0 += 1;
        if theirs["ok"] != Value::Bool(true) {
            crit_only_refused.push(format!("{kind}: {}", theirs["error"]));
            continue;
        }
        compared += 1;
        let thread = facts.threads.iter().find(|t| t.tid == pid).unwrap();
        let c = theirs["creds"].clone();
        let what = format!("run {run} ({kind}): crab read {thread:?}, CRIU's decoder {theirs}");
        let ours = thread
            .creds
            .as_ref()
            .expect("a live thread has credentials");
        let u = |k: &str| c[k].as_u64().unwrap_or(0) as u32;
        assert_eq!(
            ours.uids,
            [u("uid"), u("euid"), u("suid"), u("fsuid")],
            "{what}"
        );
        assert_eq!(
            ours.gids,
            [u("gid"), u("egid"), u("sgid"), u("fsgid")],
            "{what}"
        );
        let groups: Vec<u32> = c["groups"]
            .as_array()
            .map(|g| g.iter().map(|v| v.as_u64().unwrap() as u32).collect())
            .unwrap_or_default();
        assert_eq!(ours.groups, groups, "{what}");
        for (set, key) in [
            (ours.cap_inh, "cap_inh"),
            (ours.cap_prm, "cap_prm"),
            (ours.cap_eff, "cap_eff"),
            (ours.cap_bnd, "cap_bnd"),
            (ours.cap_amb, "cap_amb"),
        ] {
            assert_eq!(set, cap_set(&c[key]), "{key}: {what}");
        }
        assert_eq!(
            ours.no_new_privs,
            c["no_new_privs"].as_u64().unwrap_or(0) != 0 || c["no_new_privs"] == true,
            "{what}"
        );
        // An enum: pycriu gives its name (seccomp_mode in CRIU's core.proto).
        let mode = match &theirs["seccomp_mode"] {
            Value::String(s) => match s.as_str() {
                "disabled" => 0,
                "strict" => 1,
                "filter" => 2,
                other => panic!("seccomp mode {other:?}: {what}"),
            },
            v => v.as_u64().unwrap_or(0),
        };
        assert_eq!(u64::from(ours.seccomp_mode), mode, "{what}");
        // No task_core (its tag flipped): no comm for either, which crab holds as "".
        assert_eq!(
            thread.comm.as_str(),
            theirs["comm"].as_str().unwrap_or(""),
            "{what}"
        );
    }
    let _ = decoder.kill();
    let _ = decoder.wait();
    eprintln!(
        "{runs} mutated core images: crab and CRIU's decoder agreed on {compared} crab accepted, \
         crab refused {refused}; CRIU's decoder alone refused {} crab accepted",
        crit_only_refused.len()
    );
    for (kind, (accepted, refused)) in &kinds {
        eprintln!("  {kind}: crab accepted {accepted}, refused {refused}");
    }
    for e in crit_only_refused.iter().take(5) {
        eprintln!("  CRIU's decoder alone refused: {e}");
    }
    // Not vacuous: both readers agreed on a real share, and crab refused the duplicates.
    assert!(compared >= runs / 10, "only {compared} images compared");
    assert!(
        kinds["second creds"].1 > 0 && kinds["second creds"].0 == 0,
        "{kinds:?}"
    );
    assert!(kinds["second thread_core"].0 == 0, "{kinds:?}");
}
