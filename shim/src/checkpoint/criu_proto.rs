//! The reader of CRIU's image files and protobuf messages, shared by everything that decodes
//! them (the facts a restore is decided on, the pages a lazy restore brings back eagerly,
//! CRIU's RPC answers, the pstree of a dump).
//!
//! An image file is a small head of magic numbers followed by protobuf entries, each prefixed
//! with its length (`u32`, little endian). The input is untrusted: every length is checked
//! against what is left and anything unexpected is an error, never a guess.

/// The head of every image file but the inventory (CRIU's `IMG_COMMON_MAGIC`).
pub(crate) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;

/// The entries of an image file after its magic numbers.
pub(crate) fn entries(bytes: &[u8], magic: u32, common_head: bool) -> Result<Vec<&[u8]>, String> {
    let mut rest = bytes;
    let mut take_u32 = |what: &str| -> Result<u32, String> {
        let (head, tail) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| format!("cut short in {what}"))?;
        rest = tail;
        Ok(u32::from_le_bytes(*head))
    };
    if common_head {
        let m = take_u32("the head")?;
        if m != IMG_COMMON_MAGIC {
            return Err(format!("head magic {m:#x}, not CRIU's"));
        }
    }
    let m = take_u32("the magic")?;
    if m != magic {
        return Err(format!("magic {m:#x}, expected {magic:#x}"));
    }
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or("an entry's length is cut short")?;
        let len = u32::from_le_bytes(*len) as usize;
        if len > tail.len() {
            return Err(format!(
                "an entry of {len} bytes, with {} left in the file",
                tail.len()
            ));
        }
        let (entry, tail) = tail.split_at(len);
        out.push(entry);
        rest = tail;
    }
    Ok(out)
}

/// The one entry of a single-entry image file.
pub(crate) fn single(bytes: &[u8], magic: u32, common_head: bool) -> Result<&[u8], String> {
    match entries(bytes, magic, common_head)?.as_slice() {
        [one] => Ok(one),
        other => Err(format!("{} entries, expected one", other.len())),
    }
}

/// The fields CRIU's `.proto` files give a message the checks read (`images/*.proto` of CRIU
/// 4.2): its name, every field number it knows, and those that are `repeated`. A message is
/// read as CRIU's protobuf-c would read it only if it has no field outside these (which a newer
/// CRIU could give a meaning crab does not know) and no non-repeated field twice (protobuf
/// keeps the last scalar but *merges* repeated embedded messages: two `creds` entries are one
/// to CRIU, with the first one's capability arrays and the second one's ids). Both are refused.
pub(crate) struct Schema {
    pub(crate) name: &'static str,
    pub(crate) known: &'static [u32],
    pub(crate) repeated: &'static [u32],
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
    pub(crate) fn varint(self, what: &str) -> Result<u64, String> {
        match self {
            Value::Varint(v) => Ok(v),
            _ => Err(format!("{what} is not a varint")),
        }
    }

    pub(crate) fn u32(self, what: &str) -> Result<u32, String> {
        let v = self.varint(what)?;
        u32::try_from(v).map_err(|_| format!("{what} {v} does not fit 32 bits"))
    }

    pub(crate) fn bytes(self, what: &str) -> Result<&'a [u8], String> {
        match self {
            Value::Bytes(b) => Ok(b),
            _ => Err(format!("{what} is not length-delimited")),
        }
    }

    /// A repeated uint32, packed or not.
    pub(crate) fn repeated_u32(self, what: &str, out: &mut Vec<u32>) -> Result<(), String> {
        match self {
            Value::Varint(_) => out.push(self.u32(what)?),
            Value::Bytes(mut b) => {
                while !b.is_empty() {
                    let (v, n) = varint(b).ok_or_else(|| format!("{what}: a bad packed varint"))?;
                    out.push(
                        u32::try_from(v).map_err(|_| format!("{what} {v} does not fit 32 bits"))?,
                    );
                    b = &b[n..];
                    if out.len() > 1 << 20 {
                        return Err(format!("{what}: too many values"));
                    }
                }
            }
            _ => return Err(format!("{what} is neither a varint nor packed")),
        }
        Ok(())
    }
}

/// The varint at `buf[*pos..]`, moving `pos` past it: for the other hand-written protobuf
/// readers of the checkpoint code (CRIU's RPC answers, the pstree of a dump).
pub(crate) fn varint_at(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let (v, n) = varint(buf.get(*pos..)?)?;
    *pos += n;
    Some(v)
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
    rest: &'a [u8],
    failed: bool,
    /// With a schema: the non-repeated fields seen so far (all numbers are below 64).
    strict: Option<(&'static Schema, u64)>,
}

impl<'a> Fields<'a> {
    /// The fields of a message read by CRIU's schema `schema`: an unknown field or a
    /// non-repeated one seen twice is an error (see [`Schema`]).
    pub(crate) fn strict(msg: &'a [u8], schema: &'static Schema) -> Self {
        Fields {
            rest: msg,
            failed: false,
            strict: Some((schema, 0)),
        }
    }

    fn check(&mut self, number: u32) -> Result<(), String> {
        let Some((schema, seen)) = self.strict.as_mut() else {
            return Ok(());
        };
        if !schema.known.contains(&number) {
            return Err(format!(
                "{} has a field {number} CRIU's schema does not know",
                schema.name
            ));
        }
        if !schema.repeated.contains(&number) {
            let bit = 1u64 << number;
            if *seen & bit != 0 {
                return Err(format!(
                    "{} has its field {number} twice (CRIU would merge them)",
                    schema.name
                ));
            }
            *seen |= bit;
        }
        Ok(())
    }

    fn next_field(&mut self) -> Result<(u32, Value<'a>), String> {
        let (key, n) = varint(self.rest).ok_or("a bad field key")?;
        self.rest = &self.rest[n..];
        let number = u32::try_from(key >> 3).map_err(|_| "a field number out of range")?;
        if number == 0 {
            return Err("field number 0".into());
        }
        let take = |rest: &mut &'a [u8], len: usize| -> Result<&'a [u8], String> {
            if len > rest.len() {
                return Err(format!("a field of {len} bytes, {} left", rest.len()));
            }
            let (head, tail) = rest.split_at(len);
            *rest = tail;
            Ok(head)
        };
        let value = match key & 7 {
            0 => {
                let (v, n) = varint(self.rest).ok_or("a bad varint")?;
                self.rest = &self.rest[n..];
                Value::Varint(v)
            }
            1 => {
                take(&mut self.rest, 8)?;
                Value::Fixed64
            }
            2 => {
                let (len, n) = varint(self.rest).ok_or("a bad length")?;
                self.rest = &self.rest[n..];
                let len = usize::try_from(len).map_err(|_| "a length out of range")?;
                Value::Bytes(take(&mut self.rest, len)?)
            }
            5 => {
                take(&mut self.rest, 4)?;
                Value::Fixed32
            }
            t => return Err(format!("wire type {t}")),
        };
        Ok((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), String>;

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
