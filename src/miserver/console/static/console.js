// miServer console: live progress over Socket.IO (Engine.IO v4 on a WebSocket, written here so nothing is
// loaded from another host), and the create page's upload with a progress bar and a cost estimate.
(function () {
  "use strict";
  var TERMINAL = ["completed", "failed", "expired", "cancelled"];
  var main = document.getElementById("main");
  var csrf = main ? main.getAttribute("data-csrf") : null;

  function watched() {
    var nodes = document.querySelectorAll("[data-batch-id]");
    var out = [];
    for (var i = 0; i < nodes.length; i++) out.push(nodes[i]);
    return out;
  }

  function field(node, name) { return node.querySelector('[data-field="' + name + '"]'); }

  var inflight = {};  // batch id -> true while its row is being fetched; "again" when a newer change came meanwhile

  function rowOf(id) {
    var nodes = watched();
    for (var i = 0; i < nodes.length; i++) if (nodes[i].getAttribute("data-batch-id") === id) return nodes[i];
    return null;
  }

  function refreshRow(node) {
    var id = node.getAttribute("data-batch-id");
    if (node.id === "detail") {  // the detail page: in place until the job ends, then once in full
      if (TERMINAL.indexOf(node.getAttribute("data-status")) >= 0) window.location.reload();
      return;
    }
    if (inflight[id]) { inflight[id] = "again"; return; }
    inflight[id] = true;
    var next = node.getAttribute("data-next") || "/console/";
    fetch("/console/batches/" + encodeURIComponent(id) + "/row?next=" + encodeURIComponent(next),
          {credentials: "same-origin", headers: {"Accept": "text/html"}, redirect: "manual"})
      .then(function (r) { return r.ok ? r.text() : null; })  // signed out: a redirect, never a row
      .then(function (html) {
        var current = rowOf(id);
        if (html && current && current.parentNode) {
          var body = document.createElement("tbody");
          body.innerHTML = html.trim();
          var row = body.firstElementChild;
          if (row) current.parentNode.replaceChild(row, current);
        }
      })
      .finally(function () {
        var again = inflight[id] === "again";
        delete inflight[id];
        var current = rowOf(id);
        if (again && current) refreshRow(current);
      });
  }

  function apply(p) {
    var nodes = watched();
    for (var i = 0; i < nodes.length; i++) {
      var node = nodes[i];
      if (node.getAttribute("data-batch-id") !== p.id) continue;
      var c = p.request_counts || {total: 0, completed: 0, failed: 0};
      var done = c.completed + c.failed;
      var bar = field(node, "bar");
      if (bar) { bar.max = c.total || 1; bar.value = done; }
      var counts = field(node, "counts");
      if (counts) counts.textContent = done + " / " + c.total;
      var status = field(node, "status");
      var changed = node.getAttribute("data-status") !== p.status;
      if (status) { status.textContent = p.status; status.className = "status s-" + p.status; }
      var waiting = field(node, "waiting");
      var reason = p.millm && p.millm.waiting_reason;
      if (waiting) waiting.textContent = reason ? "waiting: " + reason : "";
      if (changed) { node.setAttribute("data-status", p.status); refreshRow(node); }
    }
  }

  // -- Socket.IO (protocol 5 over Engine.IO 4, WebSocket transport) --------------------------------------------
  var socket = null, fallback = null, ackId = 0;

  function subscribeAll() {
    var nodes = watched();
    for (var i = 0; i < nodes.length; i++) {
      var id = nodes[i].getAttribute("data-batch-id");
      if (TERMINAL.indexOf(nodes[i].getAttribute("data-status")) >= 0) continue;
      socket.send("42" + (ackId++) + JSON.stringify(["subscribe", {batch_id: id}]));
    }
  }

  function pollRows() {  // only while the socket is down
    var nodes = watched();
    for (var i = 0; i < nodes.length; i++) {
      if (TERMINAL.indexOf(nodes[i].getAttribute("data-status")) < 0) refreshRow(nodes[i]);
    }
  }

  function connect() {
    if (!watched().length || !window.WebSocket) return;
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + window.location.host + "/socket.io/?EIO=4&transport=websocket");
    socket.onmessage = function (ev) {
      var data = String(ev.data);
      if (data === "2") { socket.send("3"); return; }          // ping -> pong
      if (data.charAt(0) === "0") { socket.send("40"); return; } // open -> connect to "/"
      if (data.indexOf("40") === 0) {                             // connected
        if (fallback) { clearInterval(fallback); fallback = null; }
        document.documentElement.setAttribute("data-live", "socket");
        subscribeAll();
        return;
      }
      if (data.indexOf("42") === 0) {
        var payload = JSON.parse(data.slice(2).replace(/^[0-9]+/, ""));
        if (payload[0] === "batch:progress") apply(payload[1]);
      }
    };
    socket.onclose = function () {
      document.documentElement.setAttribute("data-live", "polling");
      if (!fallback) fallback = setInterval(pollRows, 5000);
      setTimeout(connect, 5000);
    };
  }

  // -- create page -----------------------------------------------------------------------------------------
  function setupCreate() {
    var input = document.getElementById("file");
    var drop = document.getElementById("drop");
    if (!input || !drop) return;
    var info = document.getElementById("file-info");
    var progress = document.getElementById("upload-progress");
    var error = document.getElementById("upload-error");
    var estimate = document.getElementById("estimate");
    var fileId = document.getElementById("file_id");
    var button = document.getElementById("create-button");
    var endpoint = document.getElementById("endpoint");

    function showEstimate() {
      if (!fileId.value) return;
      estimate.textContent = "Estimating the cost...";
      fetch("/console/files/" + encodeURIComponent(fileId.value) + "/estimate?endpoint=" +
            encodeURIComponent(endpoint.value), {credentials: "same-origin", headers: {"Accept": "application/json"}})
        .then(function (r) { return r.json().then(function (b) { return {ok: r.ok, body: b}; }); })
        .then(function (res) {
          if (!res.ok) { estimate.textContent = "No estimate: " + res.body.error.message; return; }
          var b = res.body;
          estimate.textContent = "Estimated cost: " + b.estimated_cost_text + (b.estimated_cost_is_upper_bound ?
            " (at most)" : " (rows without max_tokens not bounded)") + ", " + b.input_tokens + " input tokens.";
        });
    }

    function send(file) {
      error.hidden = true;
      fileId.value = "";
      button.disabled = true;
      info.textContent = "Uploading " + file.name + " (" + file.size + " bytes)...";
      var form = new FormData();
      form.append("purpose", "batch");
      form.append("file", file, file.name);
      var xhr = new XMLHttpRequest();
      xhr.open("POST", "/console/upload");
      xhr.setRequestHeader("X-CSRF-Token", csrf || "");
      xhr.setRequestHeader("Accept", "application/json");
      progress.hidden = false;
      progress.value = 0;
      xhr.upload.onprogress = function (ev) {
        if (ev.lengthComputable) progress.value = Math.round(100 * ev.loaded / ev.total);
      };
      xhr.onload = function () {
        var body = null;
        try { body = JSON.parse(xhr.responseText); } catch (e) { body = null; }
        if (xhr.status !== 200 || !body || !body.file) {
          error.textContent = "Upload refused: " + (body && body.error ? body.error.message : "HTTP " + xhr.status);
          error.hidden = false;
          info.textContent = "";
          progress.hidden = true;
          return;
        }
        progress.value = 100;
        fileId.value = body.file.id;
        info.textContent = file.name + ": " + body.lines + " request lines, uploaded as " + body.file.id + ".";
        info.setAttribute("data-lines", String(body.lines));
        button.disabled = false;
        showEstimate();
      };
      xhr.onerror = function () { error.textContent = "Upload failed: the connection broke."; error.hidden = false; };
      xhr.send(form);
    }

    input.addEventListener("change", function () { if (input.files.length) send(input.files[0]); });
    drop.addEventListener("dragover", function (ev) { ev.preventDefault(); drop.classList.add("over"); });
    drop.addEventListener("dragleave", function () { drop.classList.remove("over"); });
    drop.addEventListener("drop", function (ev) {
      ev.preventDefault();
      drop.classList.remove("over");
      if (ev.dataTransfer && ev.dataTransfer.files.length) send(ev.dataTransfer.files[0]);
    });
    drop.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); input.click(); }
    });
    endpoint.addEventListener("change", showEstimate);
    if (fileId.value) showEstimate();
  }

  document.addEventListener("DOMContentLoaded", function () { connect(); setupCreate(); });
})();
