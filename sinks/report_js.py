"""The report page's script and style: a small SVG charting of our own, inlined so the page needs no network.

Three chart kinds draw every view: ``line`` (series with optional 95% bands, dashed forecasts and alert
markers), ``heat`` (rank × step cells coloured by their ratio to the step's median across ranks) and
``timeline`` (one row per alert condition, firing to resolved). Each chart's div gets ``data-drawn="1"``
once drawn; a chart that throws gets its error written into it and into ``#errors``, and so does any
error the page raises (``window.onerror``), so a headless browser's DOM dump says what went wrong.
"""

STYLE = """
body{font:14px system-ui,sans-serif;margin:20px;color:#222;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
.grid{display:flex;flex-wrap:wrap;gap:12px}.chart{border:1px solid #eee;padding:4px}
.note{color:#555}.bad{color:#b00;font-weight:600}.ok{color:#070}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}
th{background:#f6f6f6}td.l,th.l{text-align:left}#errors:empty{display:none}#errors{color:#b00}
svg text{font:11px system-ui,sans-serif}
"""

SCRIPT = r"""
(function(){
const NS="http://www.w3.org/2000/svg";
const COLORS=["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#e377c2","#17becf","#7f7f7f","#bcbd22"];
const SEV={critical:"#b00",warning:"#e80",info:"#48c"};
function problem(msg){const e=document.getElementById("errors");const li=document.createElement("li");li.textContent=msg;e.appendChild(li);}
window.onerror=function(msg,src,line){problem("page error: "+msg+" (line "+line+")");};
function el(tag,attrs,parent,text){const n=document.createElementNS(NS,tag);for(const k in attrs)n.setAttribute(k,attrs[k]);if(text!==undefined)n.textContent=text;if(parent)parent.appendChild(n);return n;}
function ok(v){return v!==null&&v!==undefined&&isFinite(v);}
function fmt(v){if(!ok(v))return "–";const a=Math.abs(v);return a!==0&&(a>=1e5||a<1e-3)?v.toExponential(2):+v.toPrecision(4)+"";}
function ticks(lo,hi,n){if(!(hi>lo)){return [lo];}const raw=(hi-lo)/n,p=Math.pow(10,Math.floor(Math.log10(raw)));
  const step=[1,2,5,10].map(m=>m*p).find(s=>s>=raw);const out=[];for(let i=Math.ceil(lo/step);i*step<=hi+step*1e-9&&out.length<4*n+4;i++)out.push(+(i*step).toPrecision(12));return out;}
function extent(vals,pad){let lo=Infinity,hi=-Infinity;for(const v of vals)if(ok(v)){lo=Math.min(lo,v);hi=Math.max(hi,v);}
  if(lo===Infinity)return [0,1];if(hi-lo<=1e-9*Math.max(Math.abs(lo),Math.abs(hi))){lo-=Math.abs(lo)*0.1||1;hi+=Math.abs(hi)*0.1||1;}const d=(hi-lo)*pad;return [lo-d,hi+d];}
function frame(div,spec,xr,yr,W,H,m){
  const svg=el("svg",{width:W,height:H,viewBox:"0 0 "+W+" "+H},null);
  const sx=x=>m.l+(x-xr[0])/(xr[1]-xr[0]||1)*(W-m.l-m.r), sy=y=>H-m.b-(y-yr[0])/(yr[1]-yr[0]||1)*(H-m.t-m.b);
  el("text",{x:m.l,y:14,"font-weight":"600"},svg,spec.title||"");
  for(const t of ticks(xr[0],xr[1],6)){el("line",{x1:sx(t),x2:sx(t),y1:H-m.b,y2:H-m.b+4,stroke:"#999"},svg);
    el("text",{x:sx(t),y:H-m.b+15,"text-anchor":"middle",fill:"#555"},svg,fmt(t));}
  if(yr){for(const t of ticks(yr[0],yr[1],4)){el("line",{x1:m.l,x2:W-m.r,y1:sy(t),y2:sy(t),stroke:"#eee"},svg);
    el("text",{x:m.l-4,y:sy(t)+4,"text-anchor":"end",fill:"#555"},svg,fmt(t));}}
  el("rect",{x:m.l,y:m.t,width:W-m.l-m.r,height:H-m.t-m.b,fill:"none",stroke:"#ccc"},svg);
  el("text",{x:W-m.r,y:H-2,"text-anchor":"end",fill:"#555"},svg,spec.xlabel||"step");
  div.appendChild(svg);return {svg,sx,sy};}
function line(div,spec){
  const W=spec.width||520,H=spec.height||230,m={l:58,r:12,t:22+14*Math.ceil(spec.series.length/4),b:30};
  // The y range comes from the data and its CI bands; a forecast (dashed) is clipped to it, so a wild fit
  // cannot squash what was measured.
  const xs=[],ys=[];for(const s of spec.series){xs.push(...s.x);if(!s.forecast){ys.push(...s.y);if(s.lo)ys.push(...s.lo,...s.hi);}}
  if(!ys.some(ok))for(const s of spec.series)ys.push(...s.y);
  for(const k of spec.markers||[])xs.push(k.x);
  const f=frame(div,spec,extent(xs,0.02),extent(ys,0.05),W,H,m);
  const clip="clip"+div.id;el("rect",{x:m.l,y:m.t,width:W-m.l-m.r,height:H-m.t-m.b},el("clipPath",{id:clip},f.svg));
  const plot=el("g",{"clip-path":"url(#"+clip+")"},f.svg);
  spec.series.forEach(function(s,i){const c=s.color||COLORS[i%COLORS.length];
    if(s.lo){let pts=[];const flush=()=>{if(pts.length>1){const back=pts.map(p=>p[0]+","+p[2]).reverse();
        el("polygon",{points:pts.map(p=>p[0]+","+p[1]).concat(back).join(" "),fill:c,"fill-opacity":s.dash?0.10:0.18,stroke:"none"},plot);}pts=[];};
      s.x.forEach((x,j)=>{if(ok(s.lo[j])&&ok(s.hi[j]))pts.push([f.sx(x),f.sy(s.hi[j]),f.sy(s.lo[j])]);else flush();});flush();}
    let d="",pen=false;s.x.forEach((x,j)=>{if(ok(s.y[j])){d+=(pen?"L":"M")+f.sx(x).toFixed(1)+","+f.sy(s.y[j]).toFixed(1);pen=true;}else pen=false;});
    if(d)el("path",{d:d,fill:"none",stroke:c,"stroke-width":1.6,"stroke-dasharray":s.dash?"5,4":"none"},plot);
    const alone=j=>!ok(s.y[j-1])&&!ok(s.y[j+1]);  // a window with no neighbour draws no line: show it as a dot
    if(!s.dash)s.x.forEach((x,j)=>{if(ok(s.y[j])&&(s.points||alone(j))){const p=el("circle",{cx:f.sx(x),cy:f.sy(s.y[j]),r:2.5,fill:c},plot);
      el("title",{},p,s.name+" @ "+x+": "+fmt(s.y[j])+(s.lo&&ok(s.lo[j])?" ["+fmt(s.lo[j])+", "+fmt(s.hi[j])+"]":""));}});
    const lx=m.l+(i%4)*((W-m.l)/4),ly=30+14*Math.floor(i/4);
    el("rect",{x:lx,y:ly-8,width:10,height:3,fill:c},f.svg);el("text",{x:lx+13,y:ly-3,fill:"#333"},f.svg,String(s.name).slice(0,22));});
  for(const k of spec.markers||[]){const x=f.sx(k.x),g=el("g",{"class":"marker"},f.svg);
    el("line",{x1:x,x2:x,y1:m.t,y2:H-m.b,stroke:SEV[k.severity]||"#b00","stroke-dasharray":"2,2"},g);
    el("path",{d:"M"+(x-4)+","+m.t+"L"+(x+4)+","+m.t+"L"+x+","+(m.t+6)+"Z",fill:SEV[k.severity]||"#b00"},g);
    el("title",{},g,k.text);}
  return spec.series.length;}
function heat(div,spec){
  const R=spec.ranks.length,C=spec.steps.length,W=spec.width||1060,H=Math.max(120,Math.min(600,40+R*14+30)),m={l:58,r:12,t:22,b:30};
  const step=C>1?spec.steps[1]-spec.steps[0]:1;const f=frame(div,spec,[spec.steps[0],spec.steps[C-1]+step],null,W,H,m);
  const cw=(W-m.l-m.r)/C,ch=(H-m.t-m.b)/R;
  for(let i=0;i<R;i++){if(R<=40||i%Math.ceil(R/40)===0)el("text",{x:m.l-4,y:m.t+ch*(i+0.5)+4,"text-anchor":"end",fill:"#555"},f.svg,"rank "+spec.ranks[i]);
    for(let j=0;j<C;j++){const r=spec.ratio[i][j],v=spec.values[i][j];let col="#f3f3f3";
      if(ok(r)){const t=Math.max(-1,Math.min(1,Math.log(r)/Math.log(1.5)));
        col=t>0?"rgb(255,"+Math.round(255-200*t)+","+Math.round(255-220*t)+")":"rgb("+Math.round(255+200*t)+","+Math.round(255+120*t)+",255)";}
      const c=el("rect",{x:m.l+j*cw,y:m.t+i*ch,width:Math.ceil(cw),height:Math.ceil(ch),fill:col},f.svg);
      el("title",{},c,"rank "+spec.ranks[i]+", steps "+spec.steps[j]+"–: "+fmt(v)+" ("+(ok(r)?r.toFixed(2)+"× the median":"no data")+")");}}
  return R*C;}
function timeline(div,spec){
  const keys=[...new Set(spec.alerts.map(a=>a.key))],W=spec.width||1060,H=Math.max(90,40+keys.length*16+30),m={l:260,r:12,t:22,b:30};
  const xs=spec.alerts.map(a=>a.step).concat(spec.alerts.map(a=>a.incident)).concat(spec.span||[]);
  const f=frame(div,spec,extent(xs,0.02),null,W,H,m);const end=extent(xs,0)[1];
  keys.forEach(function(key,i){const y=m.t+6+i*16;el("text",{x:m.l-6,y:y+9,"text-anchor":"end",fill:"#333"},f.svg,key.length>42?"…"+key.slice(-41):key);
    const mine=spec.alerts.filter(a=>a.key===key);const open={};
    for(const a of mine){if(a.status==="firing"){if(!(a.incident in open))open[a.incident]=a;}
      else{const s=open[a.incident]||a;delete open[a.incident];bar(s,a.step);}}
    for(const k in open)bar(open[k],end);
    function bar(a,to){const x0=f.sx(a.incident),x1=Math.max(f.sx(to),x0+3);
      const b=el("rect",{x:x0,y:y,width:x1-x0,height:11,fill:SEV[a.severity]||"#b00","fill-opacity":0.8,"class":"alertbar"},f.svg);
      el("title",{},b,a.severity+" "+a.detector+" "+a.metric+" from step "+a.incident+" to "+to+": "+a.message);}});
  return keys.length;}
const KINDS={line:line,heat:heat,timeline:timeline};
const data=JSON.parse(document.getElementById("charts").textContent);let drawn=0;
for(const spec of data){const div=document.getElementById(spec.id);
  try{const n=KINDS[spec.kind](div,spec);div.setAttribute("data-drawn","1");div.setAttribute("data-items",n);drawn++;}
  catch(e){div.setAttribute("data-drawn","error");div.appendChild(document.createTextNode("chart failed: "+e));problem(spec.id+": "+e);}}
document.body.setAttribute("data-charts",data.length);document.body.setAttribute("data-drawn",drawn);
})();
"""
