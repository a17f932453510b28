//! stdin: data piped in arrives, and closing stdin (CloseIO) gives the process EOF.
//!
//! `ctr run` forwards its stdin but never calls CloseIO, so its container does not see EOF when
//! ctr's stdin ends (with the stock shim too); EOF is therefore tested through the gRPC API,
//! which is what a client such as crabctl or the CRI plugin uses.

use std::time::Duration;

use crab_integration::stdio::StdioOptions;
use crab_integration::{Harness, ProcessSpec};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn ctr_run_passes_piped_stdin() {
    let h = Harness::for_test().await;
    let id = h.unique_id("ctr_run_stdin");
    let _g = h.guard(&[&id]);
    let out = h
        .ctr()
        .run_with(
            &[
                "run",
                "--rm",
                "--runtime",
                h.runtime(),
                &h.env.image,
                &id,
                "sh",
                "-c",
                "read a; read b; echo \"got:$a:$b\"",
            ],
            Some(b"hello\nworld\n"),
            T,
        )
        .unwrap();
    assert_eq!(out.code(), 0, "{out:?}");
    assert_eq!(out.stdout, "got:hello:world\n", "{out:?}");
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_close_stdin_ends_cat() {
    let h = Harness::for_test().await;
    let id = h.unique_id("grpc_stdin_cat");
    let _g = h.guard(&[&id]);
    h.create_container(&id, &ProcessSpec::new(&["cat"]))
        .await
        .unwrap();
    let opts = StdioOptions {
        stdin: true,
        terminal: false,
    };
    let mut io = h.stdio(&id, "init", opts).unwrap();
    h.create_task(&id, Some(&io)).await.unwrap();
    h.start(&id, "").await.unwrap();
    let data: Vec<u8> = (0..20_000)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .collect();
    io.write_stdin(&data, T).unwrap();
    // Our writer is closed, but cat must keep running until CloseIO.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        h.wait(&id, "", Duration::from_millis(300)).await.is_err(),
        "cat exited before CloseIO"
    );
    h.close_stdin(&id, "").await.unwrap();
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 0);
    assert!(
        io.stdout(T).unwrap() == data,
        "cat's output differs from its input"
    );
    assert_eq!(h.delete_task(&id).await.unwrap(), 0);
    h.delete_container(&id).await.unwrap();
    h.assert_no_leaks(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_exec_stdin_and_close() {
    let h = Harness::for_test().await;
    let id = h.unique_id("grpc_exec_stdin");
    let _g = h.guard(&[&id]);
    h.start_detached(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let opts = StdioOptions {
        stdin: true,
        terminal: false,
    };
    let mut io = h.stdio(&id, "wc", opts).unwrap();
    h.exec(&id, "wc", &ProcessSpec::sh("wc -l; exit 9"), &io)
        .await
        .unwrap();
    h.start(&id, "wc").await.unwrap();
    io.write_stdin(b"a\nb\nc\n", T).unwrap();
    h.close_stdin(&id, "wc").await.unwrap();
    assert_eq!(h.wait(&id, "wc", T).await.unwrap(), 9);
    assert_eq!(io.stdout_string(T).unwrap().trim(), "3");
    h.delete_process(&id, "wc").await.unwrap();
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    h.assert_no_leaks(&id).await;
}
