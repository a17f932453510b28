//! The reader of CRIU's image files and protobuf messages, shared by everything that decodes
//! them (the facts a restore is decided on, the pages a lazy restore brings back eagerly,
//! CRIU's RPC answers, the pstree of a dump).
//!
//! An image file is a small head of magic numbers followed by protobuf entries, each prefixed
//! with its length (`u32`, little endian). The input is untrusted: every length is checked
//! against what is left and anything unexpected is an error ([`DecodeError`]), never a guess.

/// The head of every image file but the inventory (CRIU's `IMG_COMMON_MAGIC`).
pub(crate) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// The magic of `pstree.img`.
pub(crate) const PSTREE_MAGIC: u32 = 0x5027_3030;
/// More tasks than this in one image is not a sandbox's process tree (nor more threads in one
/// task).
pub const MAX_TASKS: usize = 65_536;

/// What is wrong with a CRIU image file or protobuf message. Offsets are bytes from the start
/// of the file (entries) or of the message (fields).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The file ends inside its magic numbers (`the head`, `the magic`).
    #[error("cut short in {0}")]
    CutShort(&'static str),
    #[error("head magic {0:#x}, not CRIU's")]
    HeadMagic(u32),
    #[error("magic {found:#x}, expected {expected:#x}")]
    Magic { found: u32, expected: u32 },
    #[error("an entry's length is cut short at byte {offset}")]
    EntryLengthCutShort { offset: usize },
    #[error("an entry of {len} bytes at byte {offset}, with {left} left in the file")]
    EntryPastEnd {
        offset: usize,
        len: usize,
        left: usize,
    },
    #[error("{0} entries, expected one")]
    EntryCount(usize),
    #[error("a bad field key at byte {offset}")]
    BadKey { offset: usize },
    #[error("a field number out of range at byte {offset}")]
    FieldNumberRange { offset: usize },
    #[error("field number 0 at byte {offset}")]
    FieldZero { offset: usize },
    #[error("wire type {wire} at byte {offset}")]
    WireType { offset: usize, wire: u64 },
    #[error("a bad varint at byte {offset}")]
    BadVarint { offset: usize },
    #[error("a bad length at byte {offset}")]
    BadLength { offset: usize },
    #[error("a field of {len} bytes at byte {offset}, {left} left")]
    FieldPastEnd {
        offset: usize,
        len: u64,
        left: usize,
    },
    /// A field of a message read by CRIU's schema ([`Schema`]) the schema does not have.
    #[error("{message} has a field {number} CRIU's schema does not know")]
    UnknownField { message: &'static str, number: u32 },
    /// A non-repeated field seen twice ([`Schema`]).
    #[error("{message} has its field {number} twice (CRIU would merge them)")]
    FieldTwice { message: &'static str, number: u32 },
    #[error("{0} is not a varint")]
    NotVarint(&'static str),
    #[error("{what} {value} does not fit 32 bits")]
    TooWide { what: &'static str, value: u64 },
    #[error("{0} is not length-delimited")]
    NotBytes(&'static str),
    #[error("{0}: a bad packed varint")]
    BadPacked(&'static str),
    #[error("{0}: too many values")]
    TooManyValues(&'static str),
    #[error("{0} is neither a varint nor packed")]
    NotRepeated(&'static str),
    /// A message without a field CRIU requires.
    #[error("{message} has no {field}")]
    Missing {
        message: &'static str,
        field: &'static str,
    },
    #[error("{0} tasks, more than {max}", max = MAX_TASKS)]
    TooManyTasks(usize),
    #[error("a task with {0} threads, more than {max}", max = MAX_TASKS)]
    TooManyThreads(usize),
}

/// The entries of an image file after its magic numbers.
pub(crate) fn entries(
    bytes: &[u8],
    magic: u32,
    common_head: bool,
) -> Result<Vec<&[u8]>, DecodeError> {
    let mut rest = bytes;
    let mut take_u32 = |what: &'static str| -> Result<u32, DecodeError> {
        let (head, tail) = rest
            .split_first_chunk::<4>()
            .ok_or(DecodeError::CutShort(what))?;
        rest = tail;
        Ok(u32::from_le_bytes(*head))
    };
    if common_head {
        let m = take_u32("the head")?;
        if m != IMG_COMMON_MAGIC {
            return Err(DecodeError::HeadMagic(m));
        }
    }
    let m = take_u32("the magic")?;
    if m != magic {
        return Err(DecodeError::Magic {
            found: m,
            expected: magic,
        });
    }
    let mut out = Vec::new();
    while !rest.is_empty() {
        let offset = bytes.len() - rest.len();
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or(DecodeError::EntryLengthCutShort { offset })?;
        let len = u32::from_le_bytes(*len) as usize;
        if len > tail.len() {
            return Err(DecodeError::EntryPastEnd {
                offset,
                len,
                left: tail.len(),
            });
        }
        let (entry, tail) = tail.split_at(len);
        out.push(entry);
        rest = tail;
    }
    Ok(out)
}

/// The one entry of a single-entry image file.
pub(crate) fn single(bytes: &[u8], magic: u32, common_head: bool) -> Result<&[u8], DecodeError> {
    match entries(bytes, magic, common_head)?.as_slice() {
        [one] => Ok(one),
        other => Err(DecodeError::EntryCount(other.len())),
    }
}

/// A protobuf field's value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32,
}

impl<'a> Value<'a> {
    pub(crate) fn varint(self, what: &'static str) -> Result<u64, DecodeError> {
        match self {
            Value::Varint(v) => Ok(v),
            _ => Err(DecodeError::NotVarint(what)),
        }
    }

    pub(crate) fn u32(self, what: &'static str) -> Result<u32, DecodeError> {
        let value = self.varint(what)?;
        u32::try_from(value).map_err(|_| DecodeError::TooWide { what, value })
    }

    pub(crate) fn bytes(self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        match self {
            Value::Bytes(b) => Ok(b),
            _ => Err(DecodeError::NotBytes(what)),
        }
    }

    /// A repeated uint32, packed or not.
    pub(crate) fn repeated_u32(
        self,
        what: &'static str,
        out: &mut Vec<u32>,
    ) -> Result<(), DecodeError> {
        match self {
            Value::Varint(_) => out.push(self.u32(what)?),
            Value::Bytes(mut b) => {
                while !b.is_empty() {
                    let (value, n) = varint(b).ok_or(DecodeError::BadPacked(what))?;
                    out.push(
                        u32::try_from(value).map_err(|_| DecodeError::TooWide { what, value })?,
                    );
                    b = &b[n..];
                    if out.len() > 1 << 20 {
                        return Err(DecodeError::TooManyValues(what));
                    }
                }
            }
            _ => return Err(DecodeError::NotRepeated(what)),
        }
        Ok(())
    }
}

/// A varint at the start of `b`: its value and length.
pub(crate) fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// The fields of one protobuf message, in order.
pub(crate) struct Fields<'a> {
    msg: &'a [u8],
    rest: &'a [u8],
    failed: bool,
    /// With a schema: the non-repeated fields seen so far (all numbers are below 64).
    strict: Option<(&'static Schema, u64)>,
}

impl<'a> Fields<'a> {
    /// The fields of a message read as they come (CRIU's RPC answers, its dump statistics):
    /// any field number, any field repeated.
    pub(crate) fn new(msg: &'a [u8]) -> Self {
        Fields {
            msg,
            rest: msg,
            failed: false,
            strict: None,
        }
    }

    /// The fields of a message read by CRIU's schema `schema`: an unknown field or a
    /// non-repeated one seen twice is an error (see [`Schema`]).
    pub(crate) fn strict(msg: &'a [u8], schema: &'static Schema) -> Self {
        Fields {
            strict: Some((schema, 0)),
            ..Fields::new(msg)
        }
    }

    fn check(&mut self, number: u32) -> Result<(), DecodeError> {
        let Some((schema, seen)) = self.strict.as_mut() else {
            return Ok(());
        };
        if !schema.known.contains(&number) {
            return Err(DecodeError::UnknownField {
                message: schema.name,
                number,
            });
        }
        if !schema.repeated.contains(&number) {
            let bit = 1u64 << number;
            if *seen & bit != 0 {
                return Err(DecodeError::FieldTwice {
                    message: schema.name,
                    number,
                });
            }
            *seen |= bit;
        }
        Ok(())
    }

    /// Where the next byte to read is, in the message.
    fn offset(&self) -> usize {
        self.msg.len() - self.rest.len()
    }

    /// The next `len` bytes of the message.
    fn take(&mut self, len: u64) -> Result<&'a [u8], DecodeError> {
        let offset = self.offset();
        let past = || DecodeError::FieldPastEnd {
            offset,
            len,
            left: self.rest.len(),
        };
        let n = usize::try_from(len).map_err(|_| past())?;
        if n > self.rest.len() {
            return Err(past());
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// A varint of the message, or `bad` at its offset.
    fn next_varint(&mut self, bad: fn(usize) -> DecodeError) -> Result<u64, DecodeError> {
        let (v, n) = varint(self.rest).ok_or_else(|| bad(self.offset()))?;
        self.rest = &self.rest[n..];
        Ok(v)
    }

    fn next_field(&mut self) -> Result<(u32, Value<'a>), DecodeError> {
        let offset = self.offset();
        let key = self.next_varint(|offset| DecodeError::BadKey { offset })?;
        let number =
            u32::try_from(key >> 3).map_err(|_| DecodeError::FieldNumberRange { offset })?;
        if number == 0 {
            return Err(DecodeError::FieldZero { offset });
        }
        let value = match key & 7 {
            0 => Value::Varint(self.next_varint(|offset| DecodeError::BadVarint { offset })?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let len = self.next_varint(|offset| DecodeError::BadLength { offset })?;
                Value::Bytes(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed32
            }
            wire => return Err(DecodeError::WireType { offset, wire }),
        };
        Ok((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let r = self
            .next_field()
            .and_then(|(number, v)| self.check(number).map(|()| (number, v)));
        self.failed = r.is_err();
        Some(r)
    }
}

/// One process of a CRIU image's process tree (`pstree.img`); pids are those of the container's
/// pid namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PstreeEntry {
    pub pid: u32,
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    /// Its threads' ids; none listed: the task is its own single thread.
    pub threads: Vec<u32>,
}

/// Parses a CRIU `pstree.img` (the common head and pstree's magic, then `pstree_entry`s: pid 1,
/// ppid 2, pgid 3, sid 4, threads 5, repeated, packed or not), root task first: the one reader
/// of a dump's process tree, for the check that a dump holds every live process and for the
/// facts a restore is decided on. Read as CRIU reads it ([`Schema`]); at most [`MAX_TASKS`]
/// tasks, and threads per task.
pub fn parse_pstree(bytes: &[u8]) -> Result<Vec<PstreeEntry>, DecodeError> {
    let list = entries(bytes, PSTREE_MAGIC, true)?;
    if list.len() > MAX_TASKS {
        return Err(DecodeError::TooManyTasks(list.len()));
    }
    let mut out = Vec::with_capacity(list.len());
    for msg in list {
        let mut e = PstreeEntry::default();
        let mut pid = None;
        for field in Fields::strict(msg, &PSTREE_ENTRY) {
            match field? {
                (1, v) => pid = Some(v.u32("pid")?),
                (2, v) => e.ppid = v.u32("ppid")?,
                (3, v) => e.pgid = v.u32("pgid")?,
                (4, v) => e.sid = v.u32("sid")?,
                (5, v) => v.repeated_u32("threads", &mut e.threads)?,
                _ => {}
            }
            if e.threads.len() > MAX_TASKS {
                return Err(DecodeError::TooManyThreads(e.threads.len()));
            }
        }
        e.pid = pid.ok_or(DecodeError::Missing {
            message: "pstree_entry",
            field: "pid",
        })?;
        out.push(e);
    }
    Ok(out)
}

pub(crate) mod schema;
pub(crate) mod schemas;
pub(crate) use schema::Schema;
use schemas::PSTREE_ENTRY;

#[cfg(test)]
mod tests;
