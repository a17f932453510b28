//! An independent tar parser (the `tar` crate) to read crab's layers back with. Also the
//! checkpoint module's unit tests' (`checkpoint::tar`, by path).
#![allow(dead_code)] // each user uses some of it

use std::io::Read;

#[derive(Debug, Clone, PartialEq)]
pub struct TarItem {
    pub kind: u8,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub data: Vec<u8>,
    pub link: Option<Vec<u8>>,
    pub dev: Option<(u32, u32)>,
    /// pax mtime if present, else the header's seconds.
    pub mtime: String,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Reads a tar with an independent parser (the `tar` crate): name -> item, in archive order.
pub fn parse_tar(tar: &[u8]) -> Vec<(String, TarItem)> {
    let mut ar = tar::Archive::new(tar);
    let mut out = Vec::new();
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let name = String::from_utf8(e.path_bytes().into_owned()).unwrap();
        let h = e.header().clone();
        let mut item = TarItem {
            kind: h.entry_type().as_byte(),
            mode: h.mode().unwrap(),
            uid: h.uid().unwrap(),
            gid: h.gid().unwrap(),
            data: Vec::new(),
            link: e.link_name_bytes().map(|l| l.into_owned()),
            dev: h
                .device_major()
                .unwrap()
                .zip(h.device_minor().unwrap())
                .filter(|_| matches!(h.entry_type().as_byte(), b'3' | b'4')),
            mtime: h.mtime().unwrap().to_string(),
            xattrs: Vec::new(),
        };
        if let Some(pax) = e.pax_extensions().unwrap() {
            for ext in pax {
                let ext = ext.unwrap();
                let key = ext.key().unwrap().to_owned();
                let value = ext.value_bytes().to_vec();
                match key.as_str() {
                    "mtime" => item.mtime = String::from_utf8(value).unwrap(),
                    "uid" => item.uid = String::from_utf8(value).unwrap().parse().unwrap(),
                    "gid" => item.gid = String::from_utf8(value).unwrap().parse().unwrap(),
                    k if k.starts_with("SCHILY.xattr.") => item
                        .xattrs
                        .push((k.as_bytes()["SCHILY.xattr.".len()..].to_vec(), value)),
                    _ => {}
                }
            }
        }
        e.read_to_end(&mut item.data).unwrap();
        out.push((name, item));
    }
    out
}

pub fn names(items: &[(String, TarItem)]) -> Vec<&str> {
    items.iter().map(|(n, _)| n.as_str()).collect()
}
