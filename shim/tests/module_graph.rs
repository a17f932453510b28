//! The shim's module structure, checked from its source: containerd's protocol appears only in
//! the protocol edge (`service` and the binary's `main.rs`), nothing in the core depends on the
//! edge, the module graph has no cycle and follows ARCHITECTURE.md's layers, and no file or
//! function is longer than the house bounds (files still over are listed and may only shrink).
//!
//! The modules are the files under `src/`; a module depends on another when it names it in a
//! path (`crate::`, `super::`, `self::` or a child module's name, in `use` trees or inline),
//! outside comments, literals and `#[cfg(test)]` items.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// The protocol edge: these modules (and their descendants) may speak containerd's protocol.
const EDGE: &[&str] = &["service"];
/// Crates that are containerd's protocol (or its encodings and transports).
const PROTOCOL_CRATES: &[&str] = &[
    "containerd_shim_protos",
    "containerd_client",
    "ttrpc",
    "protobuf",
    "prost",
    "prost_types",
    "tonic",
];
/// What the core may use of the shim framework: its reaper's exit monitor, its mount helpers,
/// its shutdown signal and error. The rest (`api`, `protos`, `publisher`, `Task`, `Shim`,
/// `TtrpcContext`, ...) is the protocol.
const SHIM_FRAMEWORK_OUTSIDE_EDGE: &[&[&str]] = &[
    &["asynchronous", "monitor"],
    &["monitor"],
    &["mount"],
    &["Error"],
    &["ExitSignal"],
];
/// Protocol names that must not appear outside the edge however they are imported.
const PROTOCOL_NAMES: &[&str] = &[
    "ttrpc",
    "protobuf",
    "RemotePublisher",
    "TtrpcContext",
    "TtrpcResult",
    "MessageDyn",
];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

// ---- lexing -------------------------------------------------------------------------------

/// `src` with comments and string/char literals blanked (newlines kept, so lines still count).
fn blank_comments_and_literals(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && starts_token(&b, i) {
            // A raw string r"..." / r#"..."# (or the identifier r#name, left alone).
            let mut j = i + 1;
            while b.get(j) == Some(&'#') {
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            j += 1;
            while j < b.len() {
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &b[i..j.min(b.len())] {
                out.push(blank(ch));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), else a lifetime.
            let end = if next == Some('\\') {
                (i + 2..b.len()).find(|&j| b[j] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for _ in i..=end {
                        out.push(' ');
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether `b[i]` begins a token (a raw string's `r` may follow a byte string's `b`).
fn starts_token(b: &[char], i: usize) -> bool {
    let ident = |j: usize| b.get(j).is_some_and(|p| p.is_alphanumeric() || *p == '_');
    match i.checked_sub(1) {
        None => true,
        Some(j) if b[j] == 'b' => j == 0 || !ident(j - 1),
        Some(j) => !ident(j),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Punct(char),
}

/// Tokens with their line numbers (1-based).
fn tokens(clean: &str) -> Vec<(Tok, usize)> {
    let b: Vec<char> = clean.chars().collect();
    let (mut out, mut line, mut i) = (Vec::new(), 1, 0);
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            let mut ident: String = b[start..i].iter().collect();
            // r#name is the identifier name.
            if ident == "r" && b.get(i) == Some(&'#') {
                i += 1;
                let start = i;
                while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                    i += 1;
                }
                ident = b[start..i].iter().collect();
            }
            out.push((Tok::Ident(ident), line));
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((
                match c {
                    '{' => Tok::Open,
                    '}' => Tok::Close,
                    ',' => Tok::Comma,
                    ';' => Tok::Semi,
                    '*' => Tok::Star,
                    c => Tok::Punct(c),
                },
                line,
            ));
            i += 1;
        }
    }
    out
}

/// The tokens without `#[cfg(test)]` items (test modules, test-only functions and imports).
fn without_test_items(toks: &[(Tok, usize)]) -> Vec<(Tok, usize)> {
    let is = |i: usize, t: Tok| toks.get(i).is_some_and(|(x, _)| *x == t);
    let ident = |i: usize, s: &str| is(i, Tok::Ident(s.into()));
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let cfg_test = is(i, Tok::Punct('#'))
            && is(i + 1, Tok::Punct('['))
            && ident(i + 2, "cfg")
            && is(i + 3, Tok::Punct('('))
            && ident(i + 4, "test")
            && is(i + 5, Tok::Punct(')'))
            && is(i + 6, Tok::Punct(']'));
        if !cfg_test {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        // Skip the item: up to its `;`, or through its braced body.
        i += 7;
        while i < toks.len() && toks[i].0 != Tok::Semi && toks[i].0 != Tok::Open {
            i += 1;
        }
        if is(i, Tok::Open) {
            let mut depth = 0;
            while i < toks.len() {
                match toks[i].0 {
                    Tok::Open => depth += 1,
                    Tok::Close => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        i += 1;
    }
    out
}

/// A path named in the source (`a::b::c`; `use` trees expanded), with its line and the inline
/// modules (`mod x { ... }`) it is named in.
#[derive(Debug, Clone, PartialEq)]
struct Named {
    segments: Vec<String>,
    line: usize,
    scope: Vec<String>,
    /// Named by a `pub use`: re-exported, part of the module's interface.
    reexport: bool,
}

/// Every path the tokens name: each leaf of every `use` tree, and every inline path.
fn named_paths(toks: &[(Tok, usize)]) -> Vec<Named> {
    let mut out = Vec::new();
    let ident_at = |i: usize| match toks.get(i) {
        Some((Tok::Ident(s), _)) => Some(s.clone()),
        _ => None,
    };
    // Inline modules: (the brace depth inside them, their name).
    let (mut scopes, mut depth): (Vec<(usize, String)>, usize) = (Vec::new(), 0);
    let mut i = 0;
    while i < toks.len() {
        let scope: Vec<String> = scopes.iter().map(|(_, n)| n.clone()).collect();
        match &toks[i].0 {
            Tok::Open => {
                depth += 1;
                i += 1;
                continue;
            }
            Tok::Close => {
                if scopes.last().is_some_and(|(d, _)| *d == depth) {
                    scopes.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
                continue;
            }
            _ => {}
        }
        if ident_at(i).as_deref() == Some("mod")
            && toks.get(i + 2).is_some_and(|(t, _)| *t == Tok::Open)
        {
            if let Some(name) = ident_at(i + 1) {
                scopes.push((depth + 1, name));
                i += 2;
                continue;
            }
        }
        // Visibility (`pub(crate)`, `pub(super)`, `pub(in path)`) names no dependency.
        let mut reexport = false;
        if ident_at(i).as_deref() == Some("pub") {
            i += 1;
            if toks.get(i).is_some_and(|(t, _)| *t == Tok::Punct('(')) {
                while i < toks.len() && toks[i].0 != Tok::Punct(')') {
                    i += 1;
                }
                i += 1;
            }
            reexport = true;
        }
        if ident_at(i).as_deref() == Some("use") {
            let line = toks[i].1;
            i += 1;
            if toks.get(i).is_some_and(|(t, _)| *t == Tok::PathSep) {
                i += 1;
            }
            let mut leaves = Vec::new();
            i = use_tree(toks, i, Vec::new(), &mut leaves);
            out.extend(leaves.into_iter().map(|segments| Named {
                segments,
                line,
                scope: scope.clone(),
                reexport,
            }));
            continue;
        }
        if reexport {
            continue;
        }
        let starts_path = ident_at(i).is_some()
            && !(i >= 1 && toks[i - 1].0 == Tok::PathSep && i >= 2 && ident_at(i - 2).is_some());
        if !starts_path {
            i += 1;
            continue;
        }
        let line = toks[i].1;
        let mut segments = vec![ident_at(i).unwrap()];
        i += 1;
        while toks.get(i).is_some_and(|(t, _)| *t == Tok::PathSep) {
            match ident_at(i + 1) {
                Some(s) => {
                    segments.push(s);
                    i += 2;
                }
                None => break,
            }
        }
        out.push(Named {
            segments,
            line,
            scope,
            reexport: false,
        });
    }
    out
}

/// Parses one use tree at `i` under `prefix`, pushing its leaves; returns where it ends.
fn use_tree(
    toks: &[(Tok, usize)],
    mut i: usize,
    prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let mut path = prefix;
    loop {
        match toks.get(i).map(|(t, _)| t) {
            Some(Tok::Ident(s)) if s == "as" => {
                i += 2;
                out.push(path);
                return skip_to_tree_end(toks, i);
            }
            Some(Tok::Ident(s)) => {
                if s != "self" {
                    path.push(s.clone());
                }
                i += 1;
            }
            Some(Tok::PathSep) => i += 1,
            Some(Tok::Star) => {
                out.push(path);
                return skip_to_tree_end(toks, i + 1);
            }
            Some(Tok::Open) => {
                i += 1;
                loop {
                    match toks.get(i).map(|(t, _)| t) {
                        Some(Tok::Close) => {
                            i += 1;
                            break;
                        }
                        Some(Tok::Comma) => i += 1,
                        None => return i,
                        _ => i = use_tree(toks, i, path.clone(), out),
                    }
                }
                return skip_to_tree_end(toks, i);
            }
            _ => {
                out.push(path);
                return skip_to_tree_end(toks, i);
            }
        }
    }
}

/// Past a finished tree: at the `,` or `}` of its group (left for the group), or past the `;`.
fn skip_to_tree_end(toks: &[(Tok, usize)], i: usize) -> usize {
    match toks.get(i).map(|(t, _)| t) {
        Some(Tok::Semi) => i + 1,
        _ => i,
    }
}

// ---- the crate's modules ------------------------------------------------------------------

struct Module {
    file: String,
    path: Vec<String>,
    /// Declared child modules (`mod x;`, `mod x { ... }`).
    children: BTreeSet<String>,
    /// Comment- and literal-free tokens, test items included.
    tokens: Vec<(Tok, usize)>,
}

/// Every `.rs` file under `src`, sorted.
fn rs_files(src: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

fn modules(src: &Path) -> Vec<Module> {
    let mods = rs_files(src)
        .into_iter()
        .map(|p| {
            let file = p.strip_prefix(src).unwrap().to_string_lossy().into_owned();
            let stem = file.trim_end_matches(".rs");
            let mut path: Vec<String> = stem.split('/').map(String::from).collect();
            if matches!(path.last().map(String::as_str), Some("mod" | "lib")) {
                path.pop();
            }
            let source = std::fs::read_to_string(&p).unwrap();
            let tokens = tokens(&blank_comments_and_literals(&source));
            let children = declared_children(&tokens);
            Module {
                file,
                path,
                children,
                tokens,
            }
        })
        .collect::<Vec<_>>();
    // A file module its parent declares under `#[cfg(test)]` (`mod tests;`) is test code, as an
    // inline test module is: not part of the library's graph.
    let test_only: BTreeSet<Vec<String>> = mods
        .iter()
        .flat_map(|m| {
            let library = declared_children(&without_test_items(&m.tokens));
            m.children
                .difference(&library)
                .map(|c| [m.path.clone(), vec![c.clone()]].concat())
                .collect::<Vec<_>>()
        })
        .collect();
    mods.into_iter()
        .filter(|m| !test_only.contains(&m.path))
        .collect()
}

/// The child modules declared in a module (`mod x;`, or inline `mod x { ... }`).
fn declared_children(tokens: &[(Tok, usize)]) -> BTreeSet<String> {
    tokens
        .windows(3)
        .filter_map(|w| match w {
            [(Tok::Ident(m), _), (Tok::Ident(name), _), (Tok::Semi | Tok::Open, _)]
                if m == "mod" =>
            {
                Some(name.clone())
            }
            _ => None,
        })
        .collect()
}

/// A module of the shim's library (not the binary's root).
fn is_library_module(m: &Module) -> bool {
    m.file != "main.rs"
}

fn in_edge(path: &[String]) -> bool {
    path.first().is_some_and(|p| EDGE.contains(&p.as_str()))
}

/// The crate-internal path `named` stands for in module `m`, if it is one.
fn crate_path(m: &Module, named: &Named) -> Option<Vec<String>> {
    let here = [m.path.clone(), named.scope.clone()].concat();
    let named = &named.segments;
    let (first, rest) = named.split_first()?;
    match first.as_str() {
        "crate" => Some(rest.to_vec()),
        "self" => Some([here, rest.to_vec()].concat()),
        "super" => {
            let mut base = here;
            base.pop()?;
            let mut rest = rest;
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
            Some([base, rest.to_vec()].concat())
        }
        child if m.children.contains(child) && named.len() > 1 => {
            Some([here, named.to_vec()].concat())
        }
        _ => None,
    }
}

type Graph = BTreeMap<Vec<String>, BTreeSet<Vec<String>>>;

/// Module → the modules it names (library modules only, test items left out), each with where
/// it first names it (`file:line`).
fn dependencies(mods: &[Module]) -> BTreeMap<Vec<String>, BTreeMap<Vec<String>, String>> {
    let known: BTreeSet<Vec<String>> = mods
        .iter()
        .filter(|m| is_library_module(m))
        .map(|m| m.path.clone())
        .collect();
    let mut deps = BTreeMap::new();
    for m in mods.iter().filter(|m| is_library_module(m)) {
        let named_here: &mut BTreeMap<Vec<String>, String> =
            deps.entry(m.path.clone()).or_default();
        for named in named_paths(&without_test_items(&m.tokens)) {
            let Some(target) = crate_path(m, &named) else {
                continue;
            };
            // The longest prefix that is a module.
            let module = (0..=target.len())
                .rev()
                .map(|n| target[..n].to_vec())
                .find(|p| known.contains(p))
                .unwrap_or_default();
            // A module re-exporting what its own submodules define is their facade, not their
            // user.
            let facade = named.reexport && module.starts_with(&m.path);
            if module != m.path && !facade {
                named_here
                    .entry(module)
                    .or_insert_with(|| format!("{}:{}", m.file, named.line));
            }
        }
    }
    deps
}

fn graph_of(deps: &BTreeMap<Vec<String>, BTreeMap<Vec<String>, String>>) -> Graph {
    deps.iter()
        .map(|(m, named)| (m.clone(), named.keys().cloned().collect()))
        .collect()
}

/// The places in module `m` that name containerd's protocol.
fn protocol_uses(m: &Module) -> Vec<String> {
    let mut found = Vec::new();
    for n in named_paths(&m.tokens) {
        let segs: Vec<&str> = n.segments.iter().map(String::as_str).collect();
        let bad = match segs.as_slice() {
            [first, ..] if PROTOCOL_CRATES.contains(first) => true,
            ["containerd_shim", rest @ ..] if !rest.is_empty() => !SHIM_FRAMEWORK_OUTSIDE_EDGE
                .iter()
                .any(|allowed| rest.starts_with(allowed)),
            _ => false,
        };
        if bad {
            found.push(format!("{}:{}: {}", m.file, n.line, segs.join("::")));
        }
    }
    for (t, line) in &m.tokens {
        if let Tok::Ident(s) = t {
            if PROTOCOL_NAMES.contains(&s.as_str()) {
                found.push(format!("{}:{line}: {s}", m.file));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// The strongly connected components with more than one module (Tarjan).
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on_stack: BTreeSet<&'a Vec<String>>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a Vec<String>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                if graph.contains_key(w) {
                    visit(s, graph.get_key_value(w).unwrap().0);
                    let lw = s.low[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                }
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                component.push(show(w));
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

fn show(path: &[String]) -> String {
    match path.is_empty() {
        true => "crate".into(),
        false => path.join("::"),
    }
}

// ---- the checks ---------------------------------------------------------------------------

#[test]
fn protocol_types_appear_only_in_the_edge() {
    let mods = modules(&src_dir());
    let mut leaks = Vec::new();
    let mut edge_uses = 0;
    for m in &mods {
        let uses = protocol_uses(m);
        if in_edge(&m.path) || m.file == "main.rs" {
            edge_uses += uses.len();
        } else {
            leaks.extend(uses);
        }
    }
    assert!(
        leaks.is_empty(),
        "containerd's protocol outside the edge ({EDGE:?}): convert to crab's own types at \
         the edge instead:\n{}",
        leaks.join("\n")
    );
    // The edge does speak the protocol: were nothing found there, the scan itself is broken.
    assert!(
        edge_uses > 10,
        "{edge_uses} protocol uses found in the edge"
    );
}

#[test]
fn nothing_depends_on_the_edge() {
    let deps = dependencies(&modules(&src_dir()));
    let upward: Vec<String> = deps
        .iter()
        .filter(|(m, _)| !in_edge(m))
        .flat_map(|(m, named)| {
            named
                .iter()
                .filter(|(d, _)| in_edge(d))
                .map(move |(d, at)| format!("{} -> {} ({at})", show(m), show(d)))
        })
        .collect();
    assert!(
        upward.is_empty(),
        "the core depends on the protocol edge:\n{}",
        upward.join("\n")
    );
    // The edge drives the core: the graph must show it, or the scan is broken.
    let service = &deps[&vec!["service".to_string()]];
    assert!(
        service.contains_key(&vec!["containers".to_string()]),
        "{service:?}"
    );
}

#[test]
fn the_module_graph_has_no_cycle() {
    let deps = dependencies(&modules(&src_dir()));
    let graph = graph_of(&deps);
    let found = cycles(&graph);
    // Each cycle with the edges inside it, and where each is named.
    let explained: Vec<String> = found
        .iter()
        .map(|members| {
            let edges: Vec<String> = deps
                .iter()
                .filter(|(m, _)| members.contains(&show(m)))
                .flat_map(|(m, named)| {
                    named
                        .iter()
                        .filter(|(d, _)| members.contains(&show(d)))
                        .map(move |(d, at)| format!("  {} -> {} ({at})", show(m), show(d)))
                })
                .collect();
            format!("{}:\n{}", members.join(" <-> "), edges.join("\n"))
        })
        .collect();
    assert!(
        found.is_empty(),
        "modules that depend on each other (each group is a cycle; move what both need \
         below both):\n{}",
        explained.join("\n")
    );
    assert!(graph.values().map(BTreeSet::len).sum::<usize>() > 50);
}

/// ARCHITECTURE.md's layer table, top first: a module may use modules of its own layer and of
/// the layers below, never one above. (Top-level module names; a folder module's files are in
/// its layer.)
const LAYERS: &[(&str, &[&str])] = &[
    ("edge", &["service"]),
    (
        "task core",
        &[
            "containers",
            "events",
            "process",
            "stdio",
            "oom",
            "logdriver",
            "placement",
            "grouping",
            "shimlog",
        ],
    ),
    ("turn path", &["sandbox", "turns", "rollback"]),
    ("restore", &["restore", "replication"]),
    ("checkpoints", &["checkpoint", "engine", "metrics"]),
    ("inspection", &["inspector"]),
    ("runtime", &["runc", "reaper", "bundle", "idmap", "error"]),
    ("system", &["sys"]),
];

/// The index of `path`'s layer in [`LAYERS`] (`None`: a module the table does not name).
fn layer_of(path: &[String]) -> Option<usize> {
    let top = path.first()?;
    LAYERS
        .iter()
        .position(|(_, mods)| mods.contains(&top.as_str()))
}

#[test]
fn every_module_is_in_a_layer_and_none_uses_a_layer_above_its_own() {
    let mods = modules(&src_dir());
    let unplaced: BTreeSet<String> = mods
        .iter()
        .filter(|m| is_library_module(m) && !m.path.is_empty() && layer_of(&m.path).is_none())
        .map(|m| show(&m.path))
        .collect();
    assert!(
        unplaced.is_empty(),
        "modules in no layer of ARCHITECTURE.md's table (add them to it and to LAYERS): \
         {unplaced:?}"
    );
    let deps = dependencies(&mods);
    let upward: Vec<String> = deps
        .iter()
        .flat_map(|(m, named)| {
            named.iter().filter_map(move |(d, at)| {
                let (from, to) = (layer_of(m)?, layer_of(d)?);
                (to < from).then(|| {
                    format!(
                        "{} ({}) -> {} ({}) at {at}",
                        show(m),
                        LAYERS[from].0,
                        show(d),
                        LAYERS[to].0
                    )
                })
            })
        })
        .collect();
    assert!(
        upward.is_empty(),
        "imports against ARCHITECTURE.md's layers (move what both need down to the lower \
         one, or pass it in):\n{}",
        upward.join("\n")
    );
    // The rule sees the graph: the task core uses the layers below it.
    let containers = &deps[&vec!["containers".to_string()]];
    assert!(
        containers.keys().any(|d| layer_of(d) == Some(3)),
        "{containers:?}"
    );
}

// ---- the scanner itself -------------------------------------------------------------------

fn module(file: &str, source: &str) -> Module {
    let tokens = tokens(&blank_comments_and_literals(source));
    let children = declared_children(&tokens);
    let mut path: Vec<String> = file
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if path.last().is_some_and(|p| p == "mod") {
        path.pop();
    }
    Module {
        file: file.into(),
        path,
        children,
        tokens,
    }
}

#[test]
fn protocol_is_found_however_it_is_imported() {
    let m = module(
        "core.rs",
        r#"
        use containerd_shim::{api, monitor::Topic, ExitSignal};
        use containerd_shim::{protos::{events::task as ev}};
        fn f() { let _ = containerd_shim_protos::topics::TASK_EXIT_EVENT_TOPIC; }
        fn g(p: &RemotePublisher) {}
        "#,
    );
    assert_eq!(
        protocol_uses(&m),
        [
            "core.rs:2: containerd_shim::api",
            "core.rs:3: containerd_shim::protos::events::task",
            "core.rs:4: containerd_shim_protos::topics::TASK_EXIT_EVENT_TOPIC",
            "core.rs:5: RemotePublisher",
        ]
    );
}

#[test]
fn comments_literals_and_the_allowed_framework_are_not_protocol() {
    let m = module(
        "core.rs",
        r##"
        //! Publishes via containerd_shim_protos (a comment).
        /* ttrpc in a /* nested */ block */
        use containerd_shim::{asynchronous::monitor::monitor_subscribe, mount, ExitSignal};
        const A: &str = "containerd_shim_protos::ttrpc";
        const B: &str = r#"protobuf "quoted""#;
        const C: char = '"';
        fn f<'a>(x: &'a str) -> &'a str { x }
        "##,
    );
    assert_eq!(protocol_uses(&m), Vec::<String>::new());
}

#[test]
fn dependencies_are_read_from_use_trees_and_paths() {
    let m = module(
        "checkpoint/mod.rs",
        r#"
        mod child;
        use crate::{bundle::{self, RootfsMount}, error::{Error, Result}};
        use super::events as ev;
        fn f() { crate::runc::Runc::new(); child::go(); self::g(); }
        mod helpers { use super::*; }
        #[cfg(test)]
        mod tests { use crate::service::x; }
        #[cfg(test)]
        use crate::service;
        "#,
    );
    let named = named_paths(&without_test_items(&m.tokens));
    let internal: BTreeSet<String> = named
        .iter()
        .filter_map(|n| crate_path(&m, n))
        .map(|p| p.join("::"))
        .collect();
    let expected: BTreeSet<String> = [
        "checkpoint",
        "bundle",
        "bundle::RootfsMount",
        "error::Error",
        "error::Result",
        "events",
        "runc::Runc::new",
        "checkpoint::child::go",
        "checkpoint::g",
    ]
    .map(String::from)
    .into();
    assert_eq!(internal, expected);
}

#[test]
fn visibility_and_facades_are_no_dependency_but_calls_are() {
    let named = |deps: &BTreeMap<Vec<String>, BTreeMap<Vec<String>, String>>| {
        deps.iter()
            .map(|(m, n)| (show(m), n.keys().map(|d| show(d)).collect::<Vec<_>>()))
            .collect::<BTreeMap<_, _>>()
    };
    let child = || {
        let mut m = module(
            "a/b.rs",
            "use super::Shared; pub(super) fn g() {} pub(in crate::a) struct S;",
        );
        m.children.clear();
        m
    };
    let facade = module(
        "a/mod.rs",
        "mod child; pub use self::child::g; pub(crate) struct Shared;",
    );
    let deps = dependencies(&[facade, child()]);
    assert_eq!(
        named(&deps),
        [("a".into(), vec![]), ("a::b".into(), vec!["a".into()])].into()
    );
    assert!(cycles(&graph_of(&deps)).is_empty());
    let user = module("a/mod.rs", "mod b; pub struct Shared; fn f() { b::g(); }");
    let deps = dependencies(&[user, child()]);
    assert_eq!(cycles(&graph_of(&deps)), [["a", "a::b"]]);
}

#[test]
fn cycles_are_found() {
    let p = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let graph: BTreeMap<_, BTreeSet<_>> = [
        (p("a"), [p("b")].into()),
        (p("b"), [p("c")].into()),
        (p("c"), [p("a"), p("d")].into()),
        (p("d"), BTreeSet::new()),
    ]
    .into();
    assert_eq!(cycles(&graph), [["a", "b", "c"]]);
}

// ---- sizes --------------------------------------------------------------------------------

/// No file under `src/` longer than this (a long file's tests go beside it, `x/tests.rs`).
const MAX_FILE_LINES: usize = 1200;
/// No function (tests included) longer than this, from its `fn` to its closing brace.
const MAX_FN_LINES: usize = 150;
/// The files still over [`MAX_FILE_LINES`], with their length when they were listed: each may
/// only get shorter, and leaves the list once under the bound (a ratchet, not a waiver). Empty
/// since the inspector's split: a file that grows past the bound is split, not listed.
const LONG_FILES: &[(&str, usize)] = &[];

/// Each function with a body in `tokens`: its name, the line of its `fn` and its length in
/// lines.
fn functions(tokens: &[(Tok, usize)]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (i, w) in tokens.windows(2).enumerate() {
        let [(Tok::Ident(f), line), (Tok::Ident(name), _)] = w else {
            continue;
        };
        if f != "fn" {
            continue;
        }
        // The body opens at the first brace before any `;` (a declaration has none).
        let Some(open) = tokens[i..]
            .iter()
            .position(|(t, _)| matches!(t, Tok::Open | Tok::Semi))
            .map(|p| i + p)
            .filter(|&p| tokens[p].0 == Tok::Open)
        else {
            continue;
        };
        let mut depth = 0usize;
        for (t, end) in &tokens[open..] {
            match t {
                Tok::Open => depth += 1,
                Tok::Close => {
                    depth -= 1;
                    if depth == 0 {
                        out.push((name.clone(), *line, end - line + 1));
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

#[test]
fn files_and_functions_stay_short() {
    let src = src_dir();
    let files = rs_files(&src);
    let (mut long_files, mut long_fns) = (Vec::new(), Vec::new());
    for p in &files {
        let file = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        let source = std::fs::read_to_string(p).unwrap();
        let lines = source.lines().count();
        let allowed = LONG_FILES
            .iter()
            .find(|(f, _)| *f == file)
            .map_or(MAX_FILE_LINES, |&(_, n)| n);
        if lines > allowed {
            long_files.push(format!("{file}: {lines} lines (at most {allowed})"));
        }
        for (name, line, n) in functions(&tokens(&blank_comments_and_literals(&source))) {
            if n > MAX_FN_LINES {
                long_fns.push(format!("{file}:{line} fn {name}: {n} lines"));
            }
        }
    }
    let stale: Vec<&str> = LONG_FILES
        .iter()
        .filter(|(f, _)| {
            std::fs::read_to_string(src.join(f))
                .map_or(true, |s| s.lines().count() <= MAX_FILE_LINES)
        })
        .map(|(f, _)| *f)
        .collect();
    assert!(
        long_files.is_empty() && long_fns.is_empty() && stale.is_empty(),
        "files over {MAX_FILE_LINES} lines (or longer than LONG_FILES lists): {long_files:#?}\n\
         functions over {MAX_FN_LINES} lines: {long_fns:#?}\n\
         LONG_FILES entries now under the bound or gone (remove them): {stale:?}"
    );
}

#[test]
fn functions_are_measured_from_fn_to_their_closing_brace() {
    let src = "fn a() {\n    let x = { 1 };\n}\ntrait T { fn b(&self); }\nfn c<F: Fn() -> u8>(f: F)\nwhere\n    F: Copy,\n{\n    f();\n}\ntype P = fn(u8) -> u8;\n";
    let found = functions(&tokens(&blank_comments_and_literals(src)));
    assert_eq!(
        found,
        vec![("a".to_string(), 1, 3), ("c".to_string(), 5, 6)]
    );
}
