use super::*;

/// From a real dump: `sh -c 'sleep 100000 & wait'` (pids 1 and 6 of the container).
const REAL_PSTREE: &[u8] = &[
    0x19, 0x43, 0x56, 0x54, 0x30, 0x30, 0x27, 0x50, 0x0a, 0, 0, 0, 0x08, 0x01, 0x10, 0x00, 0x18,
    0x01, 0x20, 0x01, 0x28, 0x01, 0x0a, 0, 0, 0, 0x08, 0x06, 0x10, 0x01, 0x18, 0x01, 0x20, 0x01,
    0x28, 0x06,
];

/// A pstree image of the entries `msgs`, under the common head.
fn pstree_of(msgs: &[&[u8]]) -> Vec<u8> {
    let mut img = REAL_PSTREE[..8].to_vec();
    for m in msgs {
        img.extend((m.len() as u32).to_le_bytes());
        img.extend_from_slice(m);
    }
    img
}

#[test]
fn pstree_decoding() {
    let tree = parse_pstree(REAL_PSTREE).unwrap();
    assert_eq!(
        tree,
        [
            PstreeEntry {
                pid: 1,
                ppid: 0,
                pgid: 1,
                sid: 1,
                threads: vec![1]
            },
            PstreeEntry {
                pid: 6,
                ppid: 1,
                pgid: 1,
                sid: 1,
                threads: vec![6]
            },
        ]
    );
    // Packed threads, a multi-byte varint.
    let img = pstree_of(&[&[0x08, 0xac, 0x02, 0x2a, 0x03, 0xac, 0x02, 0x07]]);
    assert_eq!(
        parse_pstree(&img).unwrap(),
        [PstreeEntry {
            pid: 300,
            threads: vec![300, 7],
            ..Default::default()
        }]
    );
    // No tasks at all is an empty tree (the caller decides what that means).
    assert_eq!(parse_pstree(&REAL_PSTREE[..8]).unwrap(), []);
}

/// Every way a hostile `pstree.img` can be wrong is an error saying which.
#[test]
fn hostile_pstrees_are_refused_with_their_kind() {
    let cut = &REAL_PSTREE[..REAL_PSTREE.len() - 1];
    assert_eq!(
        parse_pstree(cut).unwrap_err(),
        DecodeError::EntryPastEnd {
            offset: 22,
            len: 10,
            left: 9
        }
    );
    assert_eq!(
        parse_pstree(&REAL_PSTREE[..2]).unwrap_err(),
        DecodeError::CutShort("the head")
    );
    assert_eq!(
        parse_pstree(&REAL_PSTREE[..6]).unwrap_err(),
        DecodeError::CutShort("the magic")
    );
    assert_eq!(
        parse_pstree(&REAL_PSTREE[..10]).unwrap_err(),
        DecodeError::EntryLengthCutShort { offset: 8 }
    );
    // No head (an image of before CRIU 1.1, or not a pstree at all), another file's magic.
    assert_eq!(
        parse_pstree(&REAL_PSTREE[4..]).unwrap_err(),
        DecodeError::HeadMagic(PSTREE_MAGIC)
    );
    let mut other = REAL_PSTREE.to_vec();
    other[4] ^= 1;
    assert!(matches!(
        parse_pstree(&other).unwrap_err(),
        DecodeError::Magic {
            expected: PSTREE_MAGIC,
            ..
        }
    ));
    // A huge entry length, a huge field length.
    let mut huge = REAL_PSTREE[..8].to_vec();
    huge.extend(u32::MAX.to_le_bytes());
    huge.extend([0x08, 0x01]);
    let e = parse_pstree(&huge).unwrap_err();
    assert!(
        matches!(e, DecodeError::EntryPastEnd { left: 2, .. }),
        "{e}"
    );
    let img = pstree_of(&[&[0x08, 0x01, 0x2a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01]]);
    assert_eq!(
        parse_pstree(&img).unwrap_err(),
        DecodeError::FieldPastEnd {
            offset: 8,
            len: 0xffff_ffff,
            left: 1
        }
    );
    // A field CRIU's pstree_entry does not have, a pid twice, no pid, a pid over 32 bits.
    let cases: [(&[u8], DecodeError); 4] = [
        (
            &[0x08, 0x01, 0x32, 0x01, 0xff],
            DecodeError::UnknownField {
                message: "pstree_entry",
                number: 6,
            },
        ),
        (
            &[0x08, 0x01, 0x08, 0x02],
            DecodeError::FieldTwice {
                message: "pstree_entry",
                number: 1,
            },
        ),
        (
            &[0x10, 0x01],
            DecodeError::Missing {
                message: "pstree_entry",
                field: "pid",
            },
        ),
        (
            &[0x08, 0x80, 0x80, 0x80, 0x80, 0x10],
            DecodeError::TooWide {
                what: "pid",
                value: 1 << 32,
            },
        ),
    ];
    for (msg, want) in cases {
        assert_eq!(parse_pstree(&pstree_of(&[msg])).unwrap_err(), want);
    }
    // More threads in a task than any sandbox has.
    let mut many = vec![0x08, 0x01];
    for _ in 0..=MAX_TASKS {
        many.extend([0x28, 0x01]);
    }
    assert_eq!(
        parse_pstree(&pstree_of(&[&many])).unwrap_err(),
        DecodeError::TooManyThreads(MAX_TASKS + 1)
    );
}

#[test]
fn fields_say_where_a_message_goes_wrong() {
    fn all(msg: &[u8]) -> Result<Vec<(u32, Value<'_>)>, DecodeError> {
        Fields::new(msg).collect()
    }
    // Read as they come: any field, any number of times, fixed-width values skipped.
    let ok = all(&[
        0x08, 0x05, 0x08, 0x06, 0x11, 1, 2, 3, 4, 5, 6, 7, 8, 0x1d, 1, 2, 3, 4,
    ])
    .unwrap();
    assert_eq!(ok.len(), 4);
    assert_eq!(
        all(&[0x08, 0x01, 0x0d, 1, 2]).unwrap_err(),
        DecodeError::FieldPastEnd {
            offset: 3,
            len: 4,
            left: 2
        },
        "a fixed32 cut short"
    );
    assert_eq!(
        all(&[0x08, 0x01, 0x0b]).unwrap_err(),
        DecodeError::WireType { offset: 2, wire: 3 }
    );
    assert_eq!(
        all(&[0x08, 0xff]).unwrap_err(),
        DecodeError::BadVarint { offset: 1 }
    );
    assert_eq!(
        all(&[0xff; 11]).unwrap_err(),
        DecodeError::BadKey { offset: 0 }
    );
    assert_eq!(
        all(&[0x00, 0x01]).unwrap_err(),
        DecodeError::FieldZero { offset: 0 }
    );
    assert_eq!(
        all(&[0x12, 0x80]).unwrap_err(),
        DecodeError::BadLength { offset: 1 }
    );
    // An error ends the fields.
    let mut f = Fields::new(&[0x0b, 0x08, 0x01]);
    assert!(f.next().unwrap().is_err());
    assert!(f.next().is_none());
    // Values of the wrong kind name the field.
    let (_, v) = Fields::new(&[0x0d, 1, 2, 3, 4]).next().unwrap().unwrap();
    assert_eq!(
        v.varint("uid").unwrap_err().to_string(),
        "uid is not a varint"
    );
    assert_eq!(v.bytes("comm").unwrap_err(), DecodeError::NotBytes("comm"));
    assert_eq!(
        v.repeated_u32("groups", &mut Vec::new()).unwrap_err(),
        DecodeError::NotRepeated("groups")
    );
    assert_eq!(
        Value::Bytes(&[0x80]).repeated_u32("groups", &mut Vec::new()),
        Err(DecodeError::BadPacked("groups"))
    );
}

#[test]
fn single_entry_files_have_one_entry() {
    let img = pstree_of(&[&[0x08, 0x01], &[0x08, 0x02]]);
    assert_eq!(
        single(&img, PSTREE_MAGIC, true).unwrap_err(),
        DecodeError::EntryCount(2)
    );
    let img = pstree_of(&[&[0x08, 0x01]]);
    assert_eq!(single(&img, PSTREE_MAGIC, true).unwrap(), &[0x08, 0x01]);
    assert_eq!(
        DecodeError::CutShort("the head").to_string(),
        "cut short in the head"
    );
}
