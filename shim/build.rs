//! Compiles the eBPF programs (../bpf-programs) with clang into OUT_DIR: the
//! inspector's (`inspector.bpf.o`, embedded by `inspector::bpf`) and the
//! restore check's task iterator (`restored.bpf.o`, embedded by
//! `restore::seccomp`), each with `include_bytes!`.
//!
//! Needs clang with the BPF target (`clang-19` or `clang` on PATH, or `$CLANG`)
//! and the libbpf headers (`bpf/bpf_helpers.h`, Debian: libbpf-dev). No
//! vmlinux.h: the kernel structures read are hand-written CO-RE declarations
//! in bpf-programs/include/kernel.h, relocated at load time against the
//! running kernel's BTF.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let src_dir = manifest_dir.join("../bpf-programs");
    let include = src_dir.join("include");
    println!("cargo:rerun-if-changed={}", include.display());
    println!("cargo:rerun-if-env-changed=CLANG");
    for name in ["inspector", "restored"] {
        compile(&src_dir, &include, name);
    }
}

fn compile(src_dir: &Path, include: &Path, name: &str) {
    let source = src_dir.join(format!("{name}.bpf.c"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join(format!("{name}.bpf.o"));
    println!("cargo:rerun-if-changed={}", source.display());

    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("CARGO_CFG_TARGET_ARCH");
    let (target_arch_define, multiarch) = match arch.as_str() {
        "x86_64" => ("__TARGET_ARCH_x86", "x86_64-linux-gnu"),
        "aarch64" => ("__TARGET_ARCH_arm64", "aarch64-linux-gnu"),
        other => panic!("inspector BPF programs: unsupported target architecture {other}"),
    };

    let clang = find_clang();
    let mut cmd = Command::new(&clang);
    cmd.args(["-g", "-O2", "-target", "bpf", "-Wall"])
        .arg(format!("-D{target_arch_define}"))
        // Keeps the object byte-identical across checkouts: its hash names the
        // pin directory (see ABI in inspector::bpf).
        .arg(format!(
            "-fdebug-prefix-map={}=bpf-programs",
            src_dir.display()
        ))
        .arg("-fdebug-compilation-dir=.")
        .arg("-I")
        .arg(include);
    // <linux/types.h> pulls <asm/types.h>, which Debian keeps per architecture.
    let asm_dir = Path::new("/usr/include").join(multiarch);
    if asm_dir.is_dir() {
        cmd.arg("-I").arg(asm_dir);
    }
    cmd.arg("-c").arg(&source).arg("-o").arg(&out);

    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "running {} to compile the BPF programs: {e} (install clang-19, or set CLANG)",
            clang.display()
        )
    });
    if !status.success() {
        panic!(
            "{} failed to compile {} ({status})",
            clang.display(),
            source.display()
        );
    }
}

fn find_clang() -> PathBuf {
    if let Some(clang) = env::var_os("CLANG") {
        return PathBuf::from(clang);
    }
    let path = env::var_os("PATH").unwrap_or_default();
    for name in ["clang-19", "clang"] {
        for dir in env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!("no clang found on PATH (tried clang-19, clang): needed to compile bpf-programs; set CLANG to override");
}
