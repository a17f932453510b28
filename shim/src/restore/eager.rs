//! What a lazy restore still brings back eagerly: the pages that other processes read from a
//! restored process's memory.
//!
//! In a lazy restore (`checkpoint::lazy`) CRIU leaves every page its dump marked lazy
//! (`PE_LAZY` in `pagemap-<pid>.img`: private anonymous memory, the stack but for the page
//! under each thread's stack pointer) to the lazy-pages daemon, which hands them over on first
//! touch and then in the background, in address order: the stack, highest, last. A touch by
//! the process itself waits for its page; a read from *outside* does not (the kernel gives
//! up on a userfaultfd range when the fault cannot be retried), so until the stack arrived
//! `/proc/PID/cmdline` and `environ` read as empty: `ps` shows `[python3]`, `pgrep -f` and
//! `pkill -f` miss the process.
//!
//! So before a lazy restore the restore's own copy of each process's pagemap is rewritten:
//! the pages holding its command line and environment (`mm_arg_start..mm_arg_end` and
//! `mm_env_start..mm_env_end` of its `mm-<pid>.img`) lose their lazy flag, and CRIU's
//! restorer puts them back before the process runs, as it does the stack pointer's page.
//! Only flags change and entries split; the page data, its order in the pages file and every
//! other entry stay as signed and verified. The new file replaces the old by a rename, so a
//! hard link to the restore cache's copy is never written through.
//!
//! The image is untrusted: every file is read bounded and strictly (CRIU's schema, no unknown
//! field), a range that is not one is ignored, and anything unexpected is an error: the caller
//! then restores eagerly, which is always right.

use std::{
    fs,
    io::Write,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use crate::checkpoint::{
    criu_image::{read_bounded, CriuImageError},
    criu_proto::{
        entries,
        schemas::{MM_ENTRY, PAGEMAP_ENTRY, PAGEMAP_HEAD},
        single, DecodeError, Fields, IMG_COMMON_MAGIC,
    },
};

const PAGEMAP_MAGIC: u32 = 0x5608_4025;
const MM_MAGIC: u32 = 0x5749_2820;

/// Pagemap entry flags (CRIU's `criu/include/pagemap.h`).
const PE_PARENT: u64 = 1 << 0;
const PE_LAZY: u64 = 1 << 1;
const PE_PRESENT: u64 = 1 << 2;

/// Why the pagemaps of an image could not be rewritten (the restore is then eager).
#[derive(Debug, thiserror::Error)]
pub enum EagerError {
    #[error(transparent)]
    Image(#[from] CriuImageError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CRIU image: {} is malformed: {source}", path.display())]
    Malformed {
        path: PathBuf,
        #[source]
        source: PagemapError,
    },
}

/// What is wrong with an `mm-<pid>.img` or `pagemap-<pid>.img` file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PagemapError {
    /// CRIU's image framing or a message's encoding.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("mm_entry without its command line and environment")]
    NoCommandLine,
    #[error("a pagemap without its head")]
    NoHead,
    #[error("pagemap_entry without vaddr")]
    NoVaddr,
}

/// What [`bring_command_lines_eagerly`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Eager {
    /// Processes whose pagemap was rewritten.
    pub processes: usize,
    /// Pages that were lazy and are now restored before the processes run.
    pub pages: u64,
}

/// A page-aligned address range, `[start, end)`.
pub type Range = (u64, u64);

/// The pages of the command line and environment, by `mm_entry` (`mm-<pid>.img`): at most
/// two page-aligned ranges. A range whose end is below its start is no range (ignored).
fn command_line_pages(mm: &[u8], page: u64) -> Result<Vec<Range>, PagemapError> {
    let mut fields = [None::<u64>; 4];
    for field in Fields::strict(mm, &MM_ENTRY) {
        let (number, value) = field?;
        if (8..=11).contains(&number) {
            fields[number as usize - 8] = Some(value.varint("an mm address")?);
        }
    }
    let [Some(arg_start), Some(arg_end), Some(env_start), Some(env_end)] = fields else {
        return Err(PagemapError::NoCommandLine);
    };
    let mut out = Vec::new();
    for (start, end) in [(arg_start, arg_end), (env_start, env_end)] {
        if end <= start {
            continue;
        }
        let start = start - start % page;
        let end = end
            .checked_next_multiple_of(page)
            .unwrap_or(u64::MAX - (page - 1));
        out.push((start, end));
    }
    Ok(out)
}

/// [`command_line_pages`] of an `mm-<pid>.img` file.
pub fn mm_command_line_pages(mm_file: &[u8], page: u64) -> Result<Vec<Range>, PagemapError> {
    command_line_pages(single(mm_file, MM_MAGIC, true)?, page)
}

/// One pagemap entry, as CRIU reads it (`init_compat_pagemap_entry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub vaddr: u64,
    pub nr_pages: u64,
    pub flags: u64,
}

/// The entries of a `pagemap-<pid>.img` file (after its head), as CRIU reads them.
pub fn pagemap_entries(pagemap: &[u8]) -> Result<Vec<Entry>, PagemapError> {
    let all = entries(pagemap, PAGEMAP_MAGIC, true)?;
    let (head, rest) = all.split_first().ok_or(PagemapError::NoHead)?;
    for field in Fields::strict(head, &PAGEMAP_HEAD) {
        field?;
    }
    rest.iter().map(|m| parse_entry(m)).collect()
}

/// Whether pagemap entry flags say the pages are in this image's pages file.
pub fn present(flags: u64) -> bool {
    flags & PE_PRESENT != 0 && flags & PE_PARENT == 0
}

/// Whether pagemap entry flags leave the pages to a lazy restore's daemon.
pub fn lazy(flags: u64) -> bool {
    flags & PE_LAZY != 0
}

fn parse_entry(msg: &[u8]) -> Result<Entry, PagemapError> {
    let (mut vaddr, mut compat, mut in_parent, mut flags, mut nr) = (None, 0, false, None, None);
    for field in Fields::strict(msg, &PAGEMAP_ENTRY) {
        match field? {
            (1, v) => vaddr = Some(v.varint("vaddr")?),
            (2, v) => compat = u64::from(v.u32("compat_nr_pages")?),
            (3, v) => in_parent = v.varint("in_parent")? != 0,
            (4, v) => flags = Some(u64::from(v.u32("flags")?)),
            (5, v) => nr = Some(v.varint("nr_pages")?),
            _ => {}
        }
    }
    let flags = match (in_parent, flags) {
        (true, f) => f.unwrap_or(0) | PE_PARENT,
        (false, Some(f)) => f,
        (false, None) => PE_PRESENT,
    };
    Ok(Entry {
        vaddr: vaddr.ok_or(PagemapError::NoVaddr)?,
        nr_pages: nr.unwrap_or(compat),
        flags,
    })
}

/// An entry as CRIU writes one (`write_pagemap_loc`): vaddr, compat_nr_pages 0, flags,
/// nr_pages.
fn encode_entry(e: Entry) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    let mut put = |number: u64, v: u64| {
        for mut x in [number << 3, v] {
            while x >= 0x80 {
                out.push((x as u8) | 0x80);
                x >>= 7;
            }
            out.push(x as u8);
        }
    };
    put(1, e.vaddr);
    put(2, 0);
    put(4, e.flags);
    put(5, e.nr_pages);
    out
}

/// Splits lazy entry `e` at the edges of `eager`: the pieces in order, those inside a range
/// without the lazy flag. Only an entry whose pages are in this image's pages file (present,
/// not in a parent) and that starts on a page is split; the rest comes back as it is (an
/// entry off a page boundary is not CRIU's, and cut at page-aligned edges it would lose a
/// page: found by the fuzz target).
fn split(e: Entry, eager: &[Range], page: u64) -> Vec<Entry> {
    if e.flags & PE_LAZY == 0
        || e.flags & PE_PRESENT == 0
        || e.flags & PE_PARENT != 0
        || e.nr_pages == 0
        || !e.vaddr.is_multiple_of(page)
    {
        return vec![e];
    }
    let Some(end) = e
        .nr_pages
        .checked_mul(page)
        .and_then(|l| e.vaddr.checked_add(l))
    else {
        return vec![e];
    };
    // The cut points inside the entry, and whether each piece is eager.
    let mut cuts: Vec<u64> = eager
        .iter()
        .flat_map(|&(s, t)| [s, t])
        .filter(|&x| x > e.vaddr && x < end)
        .collect();
    cuts.push(e.vaddr);
    cuts.push(end);
    cuts.sort_unstable();
    cuts.dedup();
    let eager_at = |x: u64| eager.iter().any(|&(s, t)| s <= x && x < t);
    let mut out: Vec<Entry> = Vec::new();
    for w in cuts.windows(2) {
        let flags = match eager_at(w[0]) {
            true => e.flags & !PE_LAZY,
            false => e.flags,
        };
        match out.last_mut() {
            Some(last) if last.flags == flags => last.nr_pages += (w[1] - w[0]) / page,
            _ => out.push(Entry {
                vaddr: w[0],
                nr_pages: (w[1] - w[0]) / page,
                flags,
            }),
        }
    }
    out
}

/// `pagemap` (a `pagemap-<pid>.img`) with the pages in `eager` no longer lazy: the new file
/// and how many pages changed, or `None` when nothing changes.
pub fn rewrite_pagemap(
    pagemap: &[u8],
    eager: &[Range],
    page: u64,
) -> Result<Option<(Vec<u8>, u64)>, PagemapError> {
    let all = entries(pagemap, PAGEMAP_MAGIC, true)?;
    let (head, rest) = all.split_first().ok_or(PagemapError::NoHead)?;
    for field in Fields::strict(head, &PAGEMAP_HEAD) {
        field?;
    }
    let mut out = Vec::with_capacity(pagemap.len() + 64);
    out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
    out.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
    let push = |out: &mut Vec<u8>, msg: &[u8]| {
        out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        out.extend_from_slice(msg);
    };
    push(&mut out, head);
    let mut changed = 0u64;
    for msg in rest {
        let e = parse_entry(msg)?;
        let pieces = split(e, eager, page);
        if pieces == [e] {
            push(&mut out, msg);
            continue;
        }
        for p in pieces {
            if p.flags & PE_LAZY == 0 {
                changed += p.nr_pages;
            }
            push(&mut out, &encode_entry(p));
        }
    }
    Ok((changed > 0).then_some((out, changed)))
}

/// The system's page size (CRIU's `PAGE_SIZE` where the image is restored).
fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system; no pointer is involved.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n)
        .ok()
        .filter(|n| n.is_power_of_two())
        .unwrap_or(4096)
}

/// Rewrites the pagemap of every process of CRIU image `dir` (a restore's own copy) so that
/// its command line and environment are restored before it runs, in a lazy restore.
pub fn bring_command_lines_eagerly(dir: &Path) -> Result<Eager, EagerError> {
    let page = page_size();
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EagerError::Io { path, source }
    };
    let mut done = Eager::default();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("mm-"))
            .and_then(|n| n.strip_suffix(".img"))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let mm_path = entry.path();
        let malformed = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EagerError::Malformed { path, source }
        };
        let mm = read_bounded(&mm_path)?;
        let eager = mm_command_line_pages(&mm, page).map_err(malformed(&mm_path))?;
        let pm_path = dir.join(format!("pagemap-{id}.img"));
        if !pm_path.exists() {
            continue;
        }
        let pagemap = read_bounded(&pm_path)?;
        let Some((new, pages)) =
            rewrite_pagemap(&pagemap, &eager, page).map_err(malformed(&pm_path))?
        else {
            continue;
        };
        let tmp = dir.join(format!(".pagemap-{id}.img.eager"));
        let _ = fs::remove_file(&tmp);
        let written = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&new))
            .map_err(io(&tmp))
            .and_then(|()| fs::rename(&tmp, &pm_path).map_err(io(&pm_path)));
        if let Err(e) = written {
            // A full disk must not leave what it could not finish (the caller restores eagerly).
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        done.processes += 1;
        done.pages += pages;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::criu_image::testing::{image_file, varint_field};

    const P: u64 = 4096;

    fn entry(vaddr: u64, nr: u64, flags: u64) -> Entry {
        Entry {
            vaddr,
            nr_pages: nr,
            flags,
        }
    }

    fn pagemap(entries: &[Entry]) -> Vec<u8> {
        let mut head = Vec::new();
        varint_field(&mut head, 1, 7);
        let mut all = vec![head];
        all.extend(entries.iter().map(|&e| encode_entry(e)));
        image_file(PAGEMAP_MAGIC, true, &all)
    }

    fn read_pagemap(bytes: &[u8]) -> Vec<Entry> {
        let all = entries(bytes, PAGEMAP_MAGIC, true).unwrap();
        all[1..].iter().map(|m| parse_entry(m).unwrap()).collect()
    }

    fn mm(arg: (u64, u64), env: (u64, u64)) -> Vec<u8> {
        let mut m = Vec::new();
        for (n, v) in [
            (1, 0x400000),
            (8, arg.0),
            (9, arg.1),
            (10, env.0),
            (11, env.1),
        ] {
            varint_field(&mut m, n, v);
        }
        m
    }

    const LP: u64 = PE_LAZY | PE_PRESENT;

    #[test]
    fn the_command_line_pages_lose_the_lazy_flag_and_nothing_else_changes() {
        // The stack: 8 pages from 0x7000_0000; argv and environ in its last two pages.
        let stack = entry(0x7000_0000, 8, LP);
        let heap = entry(0x1000_0000, 100, LP);
        let eager = command_line_pages(
            &mm((0x7000_6010, 0x7000_6ff0), (0x7000_6ff0, 0x7000_7100)),
            P,
        )
        .unwrap();
        assert_eq!(
            eager,
            vec![(0x7000_6000, 0x7000_7000), (0x7000_6000, 0x7000_8000)]
        );
        let (new, changed) = rewrite_pagemap(&pagemap(&[heap, stack]), &eager, P)
            .unwrap()
            .unwrap();
        assert_eq!(changed, 2);
        assert_eq!(
            read_pagemap(&new),
            vec![
                heap,
                entry(0x7000_0000, 6, LP),
                entry(0x7000_6000, 2, PE_PRESENT)
            ]
        );
        // Pages are counted in the same order: the pieces cover the entry exactly.
        let pages = |es: &[Entry]| es.iter().map(|e| e.nr_pages).sum::<u64>();
        assert_eq!(pages(&read_pagemap(&new)), 108);
        // The head is kept.
        assert_eq!(entries(&new, PAGEMAP_MAGIC, true).unwrap()[0], &[8, 7]);
    }

    #[test]
    fn a_range_in_the_middle_splits_an_entry_in_three() {
        let e = entry(0x1000, 10, LP);
        assert_eq!(
            split(e, &[(0x3000, 0x5000)], P),
            vec![
                entry(0x1000, 2, LP),
                entry(0x3000, 2, PE_PRESENT),
                entry(0x5000, 6, LP)
            ]
        );
        // Overlapping ranges make one eager piece.
        assert_eq!(
            split(e, &[(0x3000, 0x5000), (0x4000, 0x6000)], P),
            vec![
                entry(0x1000, 2, LP),
                entry(0x3000, 3, PE_PRESENT),
                entry(0x6000, 5, LP)
            ]
        );
        // A range covering the whole entry.
        assert_eq!(
            split(e, &[(0, 0x10_0000)], P),
            vec![entry(0x1000, 10, PE_PRESENT)]
        );
        // An entry off a page boundary stays as it is (cut, it would lose a page).
        let unaligned = entry(0x1001, 10, LP);
        assert_eq!(split(unaligned, &[(0x3000, 0x5000)], P), vec![unaligned]);
        // An entry of no pages stays (CRIU's business), a range outside changes nothing.
        let empty = entry(0x1000, 0, LP);
        assert_eq!(split(empty, &[(0, 0x10_0000)], P), vec![empty]);
        assert_eq!(split(e, &[(0x20_0000, 0x30_0000)], P), vec![e]);
    }

    #[test]
    fn entries_that_are_not_lazy_in_this_image_are_left_alone() {
        let eager = [(0, u64::MAX - P + 1)];
        for flags in [PE_PRESENT, PE_PARENT, PE_PARENT | PE_LAZY, PE_LAZY] {
            let e = entry(0x1000, 4, flags);
            assert_eq!(split(e, &eager, P), vec![e], "{flags:#x}");
        }
        let pm = pagemap(&[entry(0x1000, 4, PE_PRESENT)]);
        assert_eq!(rewrite_pagemap(&pm, &eager, P).unwrap(), None);
    }

    #[test]
    fn hostile_images_are_errors_or_change_nothing_they_should_not() {
        // No command line range: nothing eager.
        assert_eq!(command_line_pages(&mm((9, 1), (9, 1)), P).unwrap(), vec![]);
        // A range up to the top of the address space does not overflow.
        let top = command_line_pages(&mm((u64::MAX - 5, u64::MAX), (0, 0)), P).unwrap();
        assert_eq!(top, vec![(u64::MAX - P + 1, u64::MAX - P + 1)]);
        // An entry whose end overflows is left alone.
        let e = entry(u64::MAX - P, 4, LP);
        assert_eq!(split(e, &[(0, u64::MAX)], P), vec![e]);
        // Missing fields, unknown fields, duplicated ones, cut short files.
        let mut unknown = mm((1, 2), (3, 4));
        varint_field(&mut unknown, 18, 1);
        assert!(command_line_pages(&unknown, P).is_err());
        let mut twice = mm((1, 2), (3, 4));
        varint_field(&mut twice, 8, 1);
        assert!(command_line_pages(&twice, P).is_err());
        let mut short = Vec::new();
        varint_field(&mut short, 8, 1);
        assert_eq!(
            command_line_pages(&short, P),
            Err(PagemapError::NoCommandLine)
        );
        let pm = pagemap(&[entry(0x1000, 4, LP)]);
        assert!(rewrite_pagemap(&pm[..pm.len() - 1], &[(0x1000, 0x2000)], P).is_err());
        assert!(rewrite_pagemap(&pm[4..], &[(0x1000, 0x2000)], P).is_err());
        let mut no_vaddr = Vec::new();
        varint_field(&mut no_vaddr, 5, 1);
        let mut head = Vec::new();
        varint_field(&mut head, 1, 7);
        let bad = image_file(PAGEMAP_MAGIC, true, &[head, no_vaddr]);
        assert_eq!(
            rewrite_pagemap(&bad, &[(0, 0x2000)], P),
            Err(PagemapError::NoVaddr)
        );
        let headless = image_file(PAGEMAP_MAGIC, true, &[]);
        assert_eq!(
            rewrite_pagemap(&headless, &[(0, 0x2000)], P),
            Err(PagemapError::NoHead)
        );
    }

    #[test]
    fn older_entries_are_read_as_criu_reads_them() {
        // compat_nr_pages only, no flags: present; in_parent: parent.
        let mut old = Vec::new();
        varint_field(&mut old, 1, 0x1000);
        varint_field(&mut old, 2, 3);
        assert_eq!(parse_entry(&old).unwrap(), entry(0x1000, 3, PE_PRESENT));
        varint_field(&mut old, 3, 1);
        assert_eq!(parse_entry(&old).unwrap(), entry(0x1000, 3, PE_PARENT));
    }

    #[test]
    fn a_directory_is_rewritten_by_rename_and_hard_links_keep_the_old_file() {
        let d = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir_in(d.path()).unwrap();
        let img = d.path().join("img");
        fs::create_dir(&img).unwrap();
        let stack = entry(0x7000_0000, 8, LP);
        let original = pagemap(&[stack]);
        fs::write(cache.path().join("pagemap-1.img"), &original).unwrap();
        fs::hard_link(
            cache.path().join("pagemap-1.img"),
            img.join("pagemap-1.img"),
        )
        .unwrap();
        let mm1 = image_file(
            MM_MAGIC,
            true,
            &[mm((0x7000_7010, 0x7000_7020), (0x7000_7020, 0x7000_7030))],
        );
        fs::write(img.join("mm-1.img"), mm1).unwrap();
        // A process without a pagemap (a zombie's files) and files that are not CRIU's.
        fs::write(
            img.join("mm-2.img"),
            image_file(MM_MAGIC, true, &[mm((1, 2), (3, 4))]),
        )
        .unwrap();
        fs::write(img.join("mm-x.img"), b"junk").unwrap();
        let done = bring_command_lines_eagerly(&img).unwrap();
        assert_eq!(
            done,
            Eager {
                processes: 1,
                pages: 1
            }
        );
        assert_eq!(
            read_pagemap(&fs::read(img.join("pagemap-1.img")).unwrap()),
            vec![entry(0x7000_0000, 7, LP), entry(0x7000_7000, 1, PE_PRESENT)]
        );
        assert_eq!(
            fs::read(cache.path().join("pagemap-1.img")).unwrap(),
            original
        );
        // Done twice: nothing more to do.
        assert_eq!(bring_command_lines_eagerly(&img).unwrap(), Eager::default());
        // A malformed mm is an error.
        fs::write(img.join("mm-3.img"), b"junk").unwrap();
        assert!(bring_command_lines_eagerly(&img).is_err());
        let names: Vec<_> = fs::read_dir(&img)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(
            names.iter().all(|n| !n.to_string_lossy().starts_with('.')),
            "{names:?}"
        );
    }
}
