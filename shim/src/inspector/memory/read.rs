//! Reading and hashing pages: through the process (`/proc/PID/mem`, `process_vm_readv`) in
//! jobs spread over threads, and shared-memory objects through their own file.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use nix::errno::Errno;
use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::{lseek, Pid, Whence};
use xxhash_rust::xxh3::xxh3_64;

use super::image::*;

/// A run of pages to read from the process.
#[derive(Debug, Clone, Copy)]
pub(super) struct Job {
    pub(super) region: usize,
    pub(super) va: u64,
    pub(super) npages: u64,
}

/// Jobs are kept small so that threads get even shares.
pub(super) const JOB_PAGES: u64 = 256;

pub(super) fn push_jobs(jobs: &mut Vec<Job>, region: usize, start: u64, end: u64) {
    let ps = page_size();
    let mut va = start;
    while va < end {
        let n = ((end - va) / ps).min(JOB_PAGES);
        jobs.push(Job {
            region,
            va,
            npages: n,
        });
        va += n * ps;
    }
}

/// Bytes read per process_vm_readv call: small enough to stay in cache while it is hashed.
pub(super) const BATCH_BYTES: u64 = 512 * 1024;
pub(super) const MAX_IOV: usize = 1024;

/// Reads and hashes the pages of `jobs` in order into `out`; returns the number of unreadable pages.
/// Hash of the page at `va` whose bytes are `page`, with the volatile ranges zeroed.
pub(super) fn hash_page(page: &mut [u8], va: u64, volatile: &[(u64, u64)]) -> u64 {
    let end = va + page.len() as u64;
    // Ranges are few (one per thread) and sorted by address.
    let first = volatile.partition_point(|r| r.0 + r.1 <= va);
    for &(a, l) in volatile[first..].iter().take_while(|r| r.0 < end) {
        let (s, e) = (a.max(va), (a + l).min(end));
        if s < e {
            page[(s - va) as usize..(e - va) as usize].fill(0);
        }
    }
    xxh3_64(page)
}

pub(super) fn read_jobs(
    pid: u32,
    mem: &File,
    jobs: &[Job],
    out: &mut [u64],
    volatile: &[(u64, u64)],
) -> Result<u64, MemError> {
    let ps = page_size();
    let mut buf = vec![0u8; BATCH_BYTES as usize];
    let mut unreadable = 0u64;
    // Runs of (address, pages) still to read in the current batch.
    let mut runs: Vec<(u64, u64)> = Vec::with_capacity(MAX_IOV);
    let mut k = 0usize; // next output slot
    let mut ji = 0usize;
    let mut job_off = 0u64; // pages of jobs[ji] already put into batches
    loop {
        // Fill a batch.
        runs.clear();
        let mut batch_pages = 0u64;
        while ji < jobs.len() && runs.len() < MAX_IOV && batch_pages * ps < BATCH_BYTES {
            let j = jobs[ji];
            let take = (j.npages - job_off).min(BATCH_BYTES / ps - batch_pages);
            let va = j.va + job_off * ps;
            match runs.last_mut() {
                Some(last) if last.0 + last.1 * ps == va => last.1 += take,
                _ => runs.push((va, take)),
            }
            batch_pages += take;
            job_off += take;
            if job_off == j.npages {
                ji += 1;
                job_off = 0;
            }
        }
        if batch_pages == 0 {
            break;
        }
        // Read it, retrying past pages that fail.
        let mut first = 0usize; // index into runs
        let mut skip = 0u64; // pages of runs[first] already done
        while first < runs.len() {
            let iov: Vec<RemoteIoVec> = runs[first..]
                .iter()
                .enumerate()
                .map(|(i, (va, n))| {
                    let (va, n) = if i == 0 {
                        (va + skip * ps, n - skip)
                    } else {
                        (*va, *n)
                    };
                    RemoteIoVec {
                        base: va as usize,
                        len: (n * ps) as usize,
                    }
                })
                .collect();
            let want: u64 = iov.iter().map(|v| v.len as u64).sum();
            // Remote addresses are only read by the kernel on the other process's behalf.
            let read = process_vm_readv(
                Pid::from_raw(pid as libc::pid_t),
                &mut [io::IoSliceMut::new(&mut buf[..want as usize])],
                &iov,
            );
            let got = match read {
                Ok(n) => n as u64,
                Err(Errno::ESRCH) => return Err(MemError::Gone(pid)),
                Err(Errno::EFAULT | Errno::EIO | Errno::ENOMEM) => 0,
                Err(e) => {
                    return Err(MemError::Io {
                        pid,
                        what: "process_vm_readv".into(),
                        source: e.into(),
                    })
                }
            };
            let full = got / ps;
            let mut va = runs[first].0 + skip * ps;
            let mut r = first;
            let mut left = runs[first].1 - skip;
            for p in 0..full as usize {
                if left == 0 {
                    r += 1;
                    va = runs[r].0;
                    left = runs[r].1;
                }
                out[k] = hash_page(
                    &mut buf[p * ps as usize..(p + 1) * ps as usize],
                    va,
                    volatile,
                );
                k += 1;
                va += ps;
                left -= 1;
            }
            // Advance the cursor by `full` pages.
            let mut adv = full;
            while adv > 0 {
                let left = runs[first].1 - skip;
                if adv >= left {
                    adv -= left;
                    first += 1;
                    skip = 0;
                } else {
                    skip += adv;
                    adv = 0;
                }
            }
            if got == want {
                break;
            }
            // The next page failed: PROT_NONE, or unmapped meanwhile. /proc/PID/mem reads with
            // FOLL_FORCE, so it gets PROT_NONE pages that still hold data.
            let va = runs[first].0 + skip * ps;
            let page = &mut buf[..ps as usize];
            out[k] = match mem.read_at(page, va) {
                Ok(n) if n as u64 == ps => hash_page(page, va, volatile),
                _ => {
                    log::debug!("pid {pid}: page {va:#x} unreadable");
                    unreadable += 1;
                    UNREADABLE
                }
            };
            k += 1;
            skip += 1;
            if skip == runs[first].1 {
                first += 1;
                skip = 0;
            }
        }
    }
    debug_assert_eq!(k, out.len());
    Ok(unreadable)
}

pub(super) const SHMEM_CHUNK: usize = 1 << 20;

/// Hashes the data (non-hole) pages of the file offsets `[lo, hi)` of a shmem object from the
/// object itself, appending `(file offset, hash)` of those that are not all zeros to `pages`;
/// `charge` is told the bytes of each chunk before it is read (and may refuse them). Returns
/// the number of pages read. Pages past the file's end read as zeros (a process would get
/// SIGBUS there, there is no data).
pub(super) fn hash_shmem(
    f: &File,
    lo: u64,
    hi: u64,
    pages: &mut Vec<(u64, u64)>,
    buf: &mut [u8],
    charge: &mut dyn FnMut(u64) -> Result<(), MemError>,
) -> Result<u64, MemError> {
    let ps = page_size();
    let zh = zero_hash();
    let mut read = 0u64;
    let mut pos = lo;
    while pos < hi {
        let Ok(data) = lseek(f.as_raw_fd(), pos as libc::off_t, Whence::SeekData) else {
            break; // ENXIO: no data after pos (EINVAL: no SEEK_DATA: handled by the else below)
        };
        let data = (data as u64 / ps) * ps;
        if data >= hi {
            break;
        }
        let hole = match lseek(f.as_raw_fd(), data as libc::off_t, Whence::SeekHole) {
            Ok(hole) => (hole as u64).div_ceil(ps) * ps,
            Err(_) => hi,
        }
        .min(hi);
        let mut off = data.max(pos);
        while off < hole {
            let len = ((hole - off) as usize).min(buf.len());
            charge(len as u64)?;
            let chunk = &mut buf[..len];
            let mut n = 0usize;
            while n < len {
                match f.read_at(&mut chunk[n..], off + n as u64) {
                    Ok(0) => break, // past EOF of a file shorter than the mapping
                    Ok(r) => n += r,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            chunk[n..].fill(0);
            for p in 0..len / ps as usize {
                let h = xxh3_64(&chunk[p * ps as usize..(p + 1) * ps as usize]);
                read += 1;
                if h != zh {
                    pages.push((off + p as u64 * ps, h));
                }
            }
            off += len as u64;
        }
        pos = hole;
    }
    Ok(read)
}
