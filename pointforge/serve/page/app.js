// The page of `pointforge serve`: every action is a call to the service's API.
"use strict";

const $ = (id) => document.getElementById(id);
let shown = null;

async function api(path, options = {}) {
  const response = await fetch(path, { credentials: "same-origin", ...options });
  if (response.status === 401 && path !== "/api/session") { signIn(); throw new Error("sign in first"); }
  const body = response.headers.get("content-type")?.includes("json") ? await response.json() : null;
  if (!response.ok) throw new Error((body && body.detail) || response.statusText);
  return body;
}

function signIn() { $("signin").hidden = false; $("main").hidden = true; }

function cell(row, text) { const td = row.insertCell(); td.textContent = text ?? ""; return td; }

function progressOf(job) {
  if (job.status === "done") return "done";
  if (job.status !== "running") return job.status;
  const bar = document.createElement("progress");
  if (job.total > 0) { bar.max = job.total; bar.value = job.done; }
  const span = document.createElement("span");
  span.append(`${job.stage} `, bar);
  return span;
}

function render(jobs) {
  const body = $("cases");
  body.replaceChildren();
  for (const job of jobs) {
    const row = body.insertRow();
    row.className = job.status;
    row.dataset.id = job.id;
    const name = cell(row, "");
    if (job.status === "done") {
      const link = document.createElement("a");
      link.href = "#" + job.id; link.textContent = job.name;
      link.addEventListener("click", () => showCase(job.id));
      name.append(link);
    } else name.textContent = job.name;
    cell(row, job.status);
    const progress = cell(row, "");
    const shownProgress = progressOf(job);
    if (typeof shownProgress === "string") progress.textContent = shownProgress; else progress.append(shownProgress);
    cell(row, job.message);
    const remove = document.createElement("button");
    remove.textContent = "delete"; remove.disabled = job.status === "running";
    remove.addEventListener("click", () => deleteCase(job.id));
    cell(row, "").append(remove);
  }
}

async function refresh() {
  try { render(await api("/api/cases")); } catch (error) { console.warn(error); }
}

async function showCase(id) {
  const job = await api(`/api/cases/${id}`);
  shown = id;
  $("case").hidden = false;
  $("case-title").textContent = job.name;
  const r = job.report || {};
  const agreement = r.agreement || {}, implant = r.implant || {}, mesh = r.mesh || {};
  $("case-summary").textContent =
    `implant ${implant.volume_cm3} cm³; mesh ${mesh.watertight ? "watertight" : "NOT watertight"}; ` +
    `agreement of the proposals in the implant: mean ${agreement.mean_in_implant}, ` +
    `unanimous ${agreement.unanimous_fraction_in_implant}; ${job.seconds} s`;
  const links = $("downloads");
  links.replaceChildren();
  for (const [kind, label] of [["implant", "implant"], ["stl", "STL (mm)"], ["uncertainty", "uncertainty"],
                               ["completed_skull", "completed skull"], ["report", "report"]]) {
    const a = document.createElement("a");
    a.href = kind === "stl" ? `/api/cases/${id}/printable.stl` : `/api/cases/${id}/files/${kind}`;
    a.textContent = label; a.id = `download-${kind}`;
    a.setAttribute("download", "");
    links.append(a);
  }
  $("view").src = `/cases/${id}/view.html`;
}

async function deleteCase(id) {
  try {
    await api(`/api/cases/${id}`, { method: "DELETE" });
    if (shown === id) { $("case").hidden = true; shown = null; }
  } catch (error) { $("upload-error").textContent = error.message; }
  refresh();
}

async function upload(event) {
  event.preventDefault();
  const file = $("file").files[0];
  $("upload-error").textContent = "";
  if (!file) { $("upload-error").textContent = "choose a file first"; return; }
  try {
    await api(`/api/cases?name=${encodeURIComponent(file.name)}`, { method: "POST", body: file });
    $("file").value = "";
  } catch (error) { $("upload-error").textContent = error.message; }
  refresh();
}

async function start() {
  $("signin-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      await api("/api/session", { method: "POST", headers: { "content-type": "application/json" },
                                  body: JSON.stringify({ token: $("token").value }) });
      $("signin").hidden = true; $("main").hidden = false; refresh();
    } catch (error) { $("signin-error").textContent = error.message; }
  });
  $("upload-form").addEventListener("submit", upload);
  setInterval(() => { if (!$("main").hidden) refresh(); }, 1000);
  try { render(await api("/api/cases")); $("main").hidden = false; } catch (error) { console.warn(error); }
}

start();
